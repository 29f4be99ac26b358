"""The ``diffspec`` console script (diffspec_jax.cli): its commands dispatch to the existing entry points."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from diffspec_jax import cli
from diffspec_jax.validation import ArgumentParser, program_name, quiet_library_notices

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


def test_generate_help_is_the_generate_clis_help_under_its_own_name():
    ours, theirs = run("diffspec_jax.cli", "generate", "--help"), run("diffspec_jax.generate", "--help")
    assert ours.returncode == theirs.returncode == 0
    options = [re.findall(r"^  (-[^\s,]+)", p.stdout, flags=re.M) for p in (ours, theirs)]
    assert options[0] == options[1] and "--stop" in options[0]
    assert ours.stdout.startswith("usage: diffspec generate [-h]") and "python -m" not in ours.stdout
    assert theirs.stdout.startswith("usage: python -m diffspec_jax.generate [-h]") and "``" not in theirs.stdout


def test_program_names():
    assert program_name("python -m x", "/venv/bin/diffspec-generate") == "diffspec-generate"  # console scripts
    assert program_name("python -m x", "diffspec generate") == "diffspec generate"  # set by diffspec_jax.cli
    for argv0 in ("/repo/diffspec_jax/generate.py", "/venv/bin/pytest", "-c"):
        assert program_name("python -m x", argv0) == "python -m x"
    argv0, seen = sys.argv[0], []

    def tool(argv):  # a tool's main, as `diffspec convert --help` runs it: named after the command
        seen.append(ArgumentParser(prog="python -m checkpoints_tools.convert").prog)
        raise SystemExit(0)

    with pytest.raises(SystemExit):
        cli._run_as("diffspec convert", tool, ["--help"])
    assert seen == ["diffspec convert"] and sys.argv[0] == argv0  # restored


def _help_parsers():
    import importlib

    yield importlib.import_module("diffspec_jax.generate").build_parser()
    if importlib.util.find_spec("fastapi") is not None:
        yield importlib.import_module("diffspec_jax.serve").build_parser()


def test_help_shows_every_options_default():
    """Every option that takes a value says its default in --help (argparse's own '(default: X)' or the help's
    words); flags are off unless given. The shared --draft help offers 'self' without restricting it."""
    for i, ap in enumerate(_help_parsers()):  # generate's: every option; serve's: every option with a default
        fmt = ap._get_formatter()
        for action in ap._actions:
            if not action.option_strings or action.nargs == 0 or (i and action.default is None):  # flags, --help
                continue
            text = " ".join(fmt._format_action(action).split())
            assert "default" in text.lower(), f"{ap.prog}: {text}"
        text = ap.format_help()
        assert "(default: 4)" in " ".join(text.split()) and "this command only" not in text
    gen = next(_help_parsers()).format_help()
    for option, default in (("--max-new-tokens", 128), ("--token-budget", 2048), ("--chunk-size", 64),
                            ("--retrieval-interval", "1 with --draft self, 4 with a draft model"),
                            ("--num-speculative-tokens", 4)):
        block = " ".join(gen[gen.index(f"  {option} "):].split("\n  -")[0].split())
        assert f"(default: {default})" in block, block


def test_transformers_framework_notice_is_silenced(monkeypatch):
    """transformers prints "PyTorch was not found ..." on import where torch is absent (a `make demo` install);
    every command calls quiet_library_notices() first, which keeps that advice off its output."""
    hide_torch = ("import importlib.util, sys; real = importlib.util.find_spec; importlib.util.find_spec = "
                  "lambda name, *a: None if name.split('.')[0] == 'torch' else real(name, *a); ")
    env = {k: v for k, v in os.environ.items()  # conftest quiets transformers for the suite: not here
           if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY")}
    notice = "PyTorch was not found"
    for setup, shown in (("", True), ("import diffspec_jax.validation as v; v.quiet_library_notices(); ", False)):
        proc = subprocess.run([sys.executable, "-c", hide_torch + setup + "import transformers"], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=120)
        assert proc.returncode == 0 and (notice in proc.stderr) == shown, proc.stderr
    import importlib

    generate = importlib.import_module("diffspec_jax.generate")
    for main, argv in ((cli.main, ["generate", "--prompt-file", "/nonexistent"]),
                       (generate.main, ["--prompt-file", "/nonexistent"])):
        monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
        assert main(argv) == 2  # fails before any model loads, after the notices are quieted
        assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"
    monkeypatch.setenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", "")  # the user's own setting is kept
    quiet_library_notices()
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == ""


def test_pyproject_license_is_an_spdx_string(monkeypatch):
    """No setuptools deprecation warnings on install: `license` is an SPDX expression (a TOML table is
    deprecated), which needs setuptools >= 77 to build."""
    import warnings

    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0" and "setuptools>=77" in project["build-system"]["requires"]
    monkeypatch.chdir(ROOT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), ROOT / "pyproject.toml")
    assert not [str(w.message) for w in caught if "license" in str(w.message).lower()]


@pytest.mark.parametrize("command, module", [("convert", "checkpoints_tools.convert"),
                                             ("inspect", "checkpoints_tools.inspect"),
                                             ("train-draft", "diffspec_jax.train_draft")])
def test_commands_dispatch_to_their_tools(command, module, capsys, monkeypatch):
    import importlib

    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    ours = capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", [f"diffspec {command}"])  # what cli.main sets while the tool runs
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    assert ours == capsys.readouterr().out and ours.startswith(f"usage: diffspec {command} ")
    assert "python -m" not in ours


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
