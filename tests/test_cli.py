"""The ``diffspec`` console script (diffspec_jax.cli): its commands dispatch to the existing entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffspec_jax import cli

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["diffspec"] == "diffspec_jax.cli:main" and scripts["diffspec-generate"] == \
        "diffspec_jax.generate:main"


def test_help_lists_every_command():
    proc = run("diffspec_jax.cli", "--help")
    assert proc.returncode == 0
    for name in ("generate", "convert", "inspect", "train-draft", "bench", "serve"):
        assert f"\n  {name} " in proc.stdout
    check = subprocess.run([sys.executable, "-c", "import sys, diffspec_jax.cli; print('jax' in sys.modules)"],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert check.stdout.strip() == "False"  # `diffspec --help` does not import JAX


def test_generate_help_is_the_generate_clis_help():
    ours, theirs = run("diffspec_jax.cli", "generate", "--help"), run("diffspec_jax.generate", "--help")
    assert ours.returncode == theirs.returncode == 0
    assert ours.stdout == theirs.stdout and "--stop STR" in ours.stdout


@pytest.mark.parametrize("command, module", [("convert", "checkpoints_tools.convert"),
                                             ("inspect", "checkpoints_tools.inspect"),
                                             ("train-draft", "diffspec_jax.train_draft")])
def test_commands_dispatch_to_their_tools(command, module, capsys):
    import importlib

    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    ours = capsys.readouterr().out
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    assert ours == capsys.readouterr().out and ours.startswith("usage: ")


def test_inspect_runs_on_a_checkpoint(tmp_path, capsys):
    import json

    from checkpoints_tools.make_tiny import make_tiny

    d = make_tiny(tmp_path / "t", "llama", seed=0)
    assert cli.main(["inspect", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["vocab_size"] == 256
    assert cli.main(["inspect", str(tmp_path / "missing")]) == 2  # the tool's own usage error


def test_bench_and_serve_and_bad_commands(tmp_path, capsys):
    assert cli.main(["bench", "nope"]) == 2 and "unknown benchmark 'nope'" in capsys.readouterr().err
    assert cli.main(["bench"]) == 2 and "lossless_check" in capsys.readouterr().out
    argv0 = sys.argv[0]
    try:
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "lossless_check", "--help"])  # from the repository root (pytest's rootdir)
    finally:
        sys.argv[0] = argv0
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("usage: diffspec bench lossless_check")
    import importlib.util

    if importlib.util.find_spec("diffspec_jax.serve") is None:
        assert cli.main(["serve"]) == 2 and "does not have" in capsys.readouterr().err
    assert cli.main([]) == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["frob"])
    assert exc.value.code == 2 and "invalid choice: 'frob'" in capsys.readouterr().err
