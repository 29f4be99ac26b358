"""Issue 26: output directories are written into a sibling and renamed into place; a non-empty --out that no
diffspec tool wrote is refused (or, with --overwrite, moved aside), an --out equal to, inside or around an input is
refused, and no file the tool did not write is ever deleted or overwritten."""

import hashlib
import json
import os
import shutil

import pytest

from diffspec_jax.errors import OutputDirError
from diffspec_jax.outdir import (MANIFEST, MARK_KEY, PARTIAL_MARKER, OutputDir, OutputFile, file_written_by_diffspec,
                                 read_manifest, verify_manifest, written_by_diffspec)


def tree_digest(root):
    """{relative path: sha256} of every file under root (to show a directory is untouched)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def user_dir(path, **files):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in (files or {"notes.txt": "my notes", "sub/data.bin": "12345"}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return tree_digest(path)


def write_some(work, text="new"):
    (work / "config.json").write_text(json.dumps({"x": text}))
    (work / "params").mkdir()
    (work / "params" / "w.bin").write_bytes(text.encode() * 10)


def siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name and p.name.startswith(path.name))


def one_line_error(err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------ OutputDir itself
def test_new_directory_is_written_through_a_partial_sibling(tmp_path):
    out = tmp_path / "a" / "out"
    with OutputDir(out, tool="t") as work:
        assert work == out.parent / "out.partial" and (work / PARTIAL_MARKER).exists() and not out.exists()
        write_some(work)
    assert set(tree_digest(out)) == {MANIFEST, "config.json", "params/w.bin"}
    assert siblings(out) == [] and verify_manifest(out)["tool"] == "t" and written_by_diffspec(out)
    body = read_manifest(out)
    assert body["files"]["params/w.bin"] == {"bytes": 30, "sha256": hashlib.sha256(b"new" * 10).hexdigest()}


def test_non_empty_foreign_directory_is_refused_and_untouched(tmp_path):
    out = tmp_path / "out"
    before = user_dir(out)
    with pytest.raises(OutputDirError, match="is not empty and was not written by a diffspec-jax tool.*--overwrite"):
        with OutputDir(out, tool="t") as work:
            write_some(work)
    assert tree_digest(out) == before and siblings(out) == []


def test_overwrite_moves_the_old_contents_aside_and_deletes_nothing(tmp_path):
    out = tmp_path / "out"
    before = user_dir(out)
    od = OutputDir(out, tool="t", overwrite=True)
    with od as work:
        write_some(work)
    assert od.replaced is not None and od.replaced.name.startswith("out.replaced-")
    assert tree_digest(od.replaced) == before  # every user file kept, byte for byte
    assert json.loads((out / "config.json").read_text()) == {"x": "new"} and written_by_diffspec(out)


def test_an_earlier_output_of_a_tool_is_replaced_without_overwrite(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, tool="t") as work:
        write_some(work, "one")
    with OutputDir(out, tool="t") as work:
        write_some(work, "two")
    assert json.loads((out / "config.json").read_text()) == {"x": "two"} and siblings(out) == []
    # ... but not once the user has added or changed a file in it
    (out / "mine.txt").write_text("keep me")
    before = tree_digest(out)
    with pytest.raises(OutputDirError, match="not empty"):
        OutputDir(out, tool="t").check()
    (out / "mine.txt").unlink()
    (out / "config.json").write_text("edited")
    with pytest.raises(OutputDirError, match="not empty"):
        OutputDir(out, tool="t").check()
    assert (out / "config.json").read_text() == "edited" and set(tree_digest(out)) == set(before) - {"mine.txt"}


def test_a_file_added_during_the_run_is_kept(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, tool="t") as work:
        write_some(work, "one")
    od = OutputDir(out, tool="t")
    with od as work:
        write_some(work, "two")
        (out / "late.txt").write_text("written meanwhile")
    assert od.replaced is not None and (od.replaced / "late.txt").read_text() == "written meanwhile"


@pytest.mark.parametrize("where", ["same", "inside_input", "input_inside"])
def test_out_equal_to_inside_or_around_an_input_is_refused(tmp_path, where):
    src = tmp_path / "src"
    before = user_dir(src)
    out = {"same": src, "inside_input": src / "sub" / "out", "input_inside": tmp_path}[where]
    if where == "input_inside":
        out = tmp_path / "big"
        src = out / "src"
        before = user_dir(src)
    needle = {"same": "is the input .* itself", "inside_input": "lies inside the input",
              "input_inside": "lies inside --out"}[where]
    with pytest.raises(OutputDirError, match=needle):
        with OutputDir(out, tool="t", inputs=[None, str(src)]):
            pass
    assert tree_digest(src) == before and not (src / "sub" / "out.partial").exists()


def test_failure_leaves_out_as_it_was(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, tool="t") as work:
        write_some(work, "one")
    before = tree_digest(out)
    with pytest.raises(RuntimeError) as info:
        with OutputDir(out, tool="t") as work:
            write_some(work, "two")
            raise RuntimeError("training crashed")
    assert tree_digest(out) == before and siblings(out) == [] and not getattr(info.value, "__notes__", None)
    # resumable tools keep what they wrote, and say where
    with pytest.raises(RuntimeError) as info:
        with OutputDir(out, tool="t", resume=True) as work:
            (work / "checkpoints").mkdir()
            (work / "checkpoints" / "step_2").write_text("state")
            raise RuntimeError("interrupted")
    assert tree_digest(out) == before and "unfinished output is kept in" in info.value.__notes__[0]
    with OutputDir(out, tool="t", resume=True) as work:  # the next run continues in the same directory
        assert (work / "checkpoints" / "step_2").read_text() == "state"
        write_some(work, "three")
    assert (out / "checkpoints" / "step_2").exists() and siblings(out) == []


def test_other_refusals(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputDirError, match="exists and is not a directory"):
        OutputDir(tmp_path / "file", tool="t").check()
    user_dir(tmp_path / "out.partial")
    with pytest.raises(OutputDirError, match="was not made by a diffspec-jax tool"):
        OutputDir(tmp_path / "out", tool="t").check()
    monkeypatch.chdir(tmp_path / "out.partial")
    with pytest.raises(OutputDirError, match="contains the current directory"):
        OutputDir(tmp_path, tool="t", overwrite=True).check()
    with pytest.raises(OutputDirError, match="file system root"):
        OutputDir("/", tool="t", overwrite=True).check()
    (tmp_path / "empty").mkdir()
    with OutputDir(tmp_path / "empty", tool="t") as work:  # an empty directory is fine
        write_some(work)
    assert (tmp_path / "empty" / MANIFEST).exists()


def test_damaged_manifest_is_not_ours(tmp_path):
    out = tmp_path / "out"
    with OutputDir(out, tool="t") as work:
        write_some(work)
    text = (out / MANIFEST).read_text()
    (out / MANIFEST).write_text(text.replace('"t"', '"u"'))
    assert not written_by_diffspec(out)
    from diffspec_jax.errors import IntegrityError

    with pytest.raises(IntegrityError, match="self digest"):
        verify_manifest(out)


# ------------------------------------------------------------------------------------------ convert
@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    from checkpoints_tools.make_tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("outdirs") / "hf", "llama", seed=4)


def test_convert_refuses_a_non_empty_out_and_keeps_it(small_hf, tmp_path, capsys):
    from checkpoints_tools import convert

    out = tmp_path / "out"
    before = user_dir(out)
    assert convert.main(["--hf", str(small_hf), "--out", str(out), "--dtype", "float32"]) == 2
    assert "pass --overwrite" in one_line_error(capsys.readouterr().err)
    assert tree_digest(out) == before and siblings(out) == []
    assert convert.main(["--hf", str(small_hf), "--out", str(out), "--dtype", "float32", "--overwrite"]) == 0
    backup = [p for p in tmp_path.iterdir() if p.name.startswith("out.replaced-")]
    assert len(backup) == 1 and tree_digest(backup[0]) == before
    assert verify_manifest(out)["tool"] == "checkpoints_tools.convert"
    # converting again into its own earlier output needs no --overwrite
    assert convert.main(["--hf", str(small_hf), "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("out.")]) == 1


@pytest.mark.parametrize("rel", [".", "sub", "sub/deeper"])
def test_convert_out_equal_to_or_inside_the_source_is_refused(small_hf, tmp_path, capsys, rel):
    from checkpoints_tools import convert

    src = tmp_path / "hf"
    shutil.copytree(small_hf, src)
    before = tree_digest(src)
    assert convert.main(["--hf", str(src), "--out", str(src / rel)]) == 2
    assert "input" in one_line_error(capsys.readouterr().err)
    assert tree_digest(src) == before and sorted(p.name for p in src.iterdir()) == sorted(
        p.name for p in small_hf.iterdir())


def test_convert_failure_keeps_the_previous_output(small_hf, tmp_path, capsys):
    from checkpoints_tools import convert

    out = tmp_path / "ob"
    assert convert.main(["--hf", str(small_hf), "--out", str(out), "--dtype", "float32"]) == 0
    before = tree_digest(out)
    bad = tmp_path / "bad"
    shutil.copytree(small_hf, bad)
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:5000])
    assert convert.main(["--hf", str(bad), "--out", str(out), "--dtype", "float32"]) == 1
    assert "damaged or incomplete" in one_line_error(capsys.readouterr().err)
    assert tree_digest(out) == before and siblings(out) == []
    # the round trip back to Hugging Face writes a manifest too, and refuses its own source
    hf_out = tmp_path / "hf"
    assert convert.main(["--orbax", str(out), "--out", str(hf_out)]) == 0
    assert verify_manifest(hf_out) is not None
    assert convert.main(["--orbax", str(out), "--out", str(out / "params")]) == 2
    assert tree_digest(out) == before


def test_bin_to_safetensors_never_replaces_existing_weights(small_hf, tmp_path, capsys):
    from checkpoints_tools import convert

    d = tmp_path / "bins"
    shutil.copytree(small_hf, d)
    (d / "pytorch_model.bin").write_bytes(b"")
    before = tree_digest(d)
    assert convert.main(["--bin-to-safetensors", str(d)]) == 2
    assert "already holds safetensors weights" in one_line_error(capsys.readouterr().err)
    assert tree_digest(d) == before


# ------------------------------------------------------------------------------------------ OutputFile
def test_output_file_refuses_a_user_file_and_rewrites_its_own(tmp_path, capsys):
    user = tmp_path / "f.txt"
    user.write_text("important\n")
    with pytest.raises(OutputDirError, match="not written by a diffspec-jax tool.*--overwrite"):
        OutputFile(user, tool="t").check()
    assert user.read_text() == "important\n" and os.listdir(tmp_path) == ["f.txt"]
    # a new file: written through a temporary sibling, rewritten as often as the run likes, marked as ours
    out = OutputFile(tmp_path / "r" / "res.json", tool="t")
    out.check()
    for n in range(3):
        out.write_json({"rows": list(range(n)), "x": float("nan")})
    body = json.loads((tmp_path / "r" / "res.json").read_text())
    assert body["rows"] == [0, 1] and body[MARK_KEY]["tool"] == "t" and os.listdir(tmp_path / "r") == ["res.json"]
    # a later run replaces it; once someone edits it, it is theirs
    assert file_written_by_diffspec(tmp_path / "r" / "res.json")
    OutputFile(tmp_path / "r" / "res.json", tool="t").write_json({"rows": [9]})
    edited = (tmp_path / "r" / "res.json").read_text().replace("9", "8")
    (tmp_path / "r" / "res.json").write_text(edited)
    with pytest.raises(OutputDirError, match="not written by a diffspec-jax tool"):
        OutputFile(tmp_path / "r" / "res.json", tool="t").write_json({"rows": []})
    assert (tmp_path / "r" / "res.json").read_text() == edited
    # --overwrite: the user's file is moved aside at the first write, never deleted
    out = OutputFile(user, tool="t", overwrite=True)
    out.check()
    out.write_json({"a": 1})
    out.write_json({"a": 2})
    assert out.replaced.read_text() == "important\n" and json.loads(user.read_text())["a"] == 2
    assert "moved to" in capsys.readouterr().err
    # a directory or a device is no output file; a file changed under a running write is left alone
    for bad in (tmp_path / "r", "/dev/null"):
        with pytest.raises(OutputDirError, match="directory|not a regular file"):
            OutputFile(bad, tool="t", overwrite=True).check()
    out = OutputFile(tmp_path / "late.json", tool="t")
    out.check()
    (tmp_path / "late.json").write_text("someone else's")
    with pytest.raises(OutputDirError, match="changed by someone else"):
        out.write_json({"a": 1})
    assert (tmp_path / "late.json").read_text() == "someone else's"


def test_png_outputs_carry_a_mark(tmp_path):
    from benchmarks.common import save_figure

    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    for _ in range(2):  # the second call replaces the first (ours)
        assert save_figure(plt.figure(), tmp_path / "f.png") == "f.png"
    assert file_written_by_diffspec(tmp_path / "f.png")
    fig = plt.figure()
    fig.savefig(tmp_path / "theirs.png")
    plt.close(fig)
    assert not file_written_by_diffspec(tmp_path / "theirs.png")
    with pytest.raises(OutputDirError):
        save_figure(plt.figure(), tmp_path / "theirs.png")
    plt.close("all")


#: every benchmark, with the arguments it needs besides --out (its output is checked before it measures anything)
BENCHMARK_ARGS = {"lossless_check": [], "copy_probe": [], "decode_ablation": [], "flash_prefill": [], "kernels": [],
                  "profile_steps": [], "paired": [], "e2e": [], "long_context": [],
                  "self_projection": ["--steps", "s.json", "--acceptance", "a=b.json"]}


@pytest.mark.parametrize("name", sorted(BENCHMARK_ARGS))
def test_every_benchmark_refuses_to_overwrite_a_user_file(name, tmp_path, capsys):
    import importlib

    main = importlib.import_module(f"benchmarks.{name}").main
    user = tmp_path / "f.txt"
    user.write_text("important\n")
    with pytest.raises(SystemExit) as info:
        main(BENCHMARK_ARGS[name] + ["--out", str(user)])
    assert info.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert user.read_text() == "important\n" and os.listdir(tmp_path) == ["f.txt"]
    if name in ("paired", "e2e", "long_context", "self_projection"):  # and the figure written beside the JSON
        (tmp_path / "r.png").write_text("my picture")
        with pytest.raises(SystemExit) as info:
            main(BENCHMARK_ARGS[name] + ["--out", str(tmp_path / "r.json")])
        assert info.value.code == 2 and "r.png" in capsys.readouterr().err
        assert (tmp_path / "r.png").read_text() == "my picture" and not (tmp_path / "r.json").exists()


def test_diffspec_bench_and_serve_load_keep_user_files(tmp_path, capsys, monkeypatch):
    from benchmarks import serve_load
    from diffspec_jax import cli

    user = tmp_path / "f.txt"
    user.write_text("important\n")
    with pytest.raises(SystemExit) as info:  # the case, through the diffspec command
        cli.main(["bench", "lossless_check", "--pair", "nowhere", "--out", str(user)])
    assert info.value.code == 2 and "f.txt exists and was not written by a diffspec-jax tool" in capsys.readouterr().err
    assert user.read_text() == "important\n"
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "serve_load.json").write_text("{}")
    for out in (user, tmp_path / "d"):
        with pytest.raises(SystemExit) as info:
            serve_load.main(["--quick", "--out", str(out)])
        assert info.value.code == 2 and "error" in capsys.readouterr().err
    assert user.read_text() == "important\n" and (tmp_path / "d" / "serve_load.json").read_text() == "{}"


# ------------------------------------------------------------------------------------------ train_draft
@pytest.fixture(scope="module")
def target_with_tokenizer(small_hf, tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tok") / "t"
    shutil.copytree(small_hf, d)
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(253)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(d)
    return d


def test_train_draft_out_is_safe(target_with_tokenizer, tmp_path, capsys):
    from diffspec_jax.train_draft import main

    data = tmp_path / "a.txt"
    data.write_text(" ".join(f"w{i % 50}" for i in range(400)))
    out = tmp_path / "draft"
    before = user_dir(out)
    args = ["--target", str(target_with_tokenizer), "--data", str(data), "--steps", "2", "--batch", "1",
            "--seq-len", "16", "--ttt-steps", "2", "--draft-vocab", "64", "--aux-layers", "0,1,2", "--eval-every", "0"]
    assert main(args + ["--out", str(out)]) == 2
    assert "not empty" in one_line_error(capsys.readouterr().err)
    assert tree_digest(out) == before and siblings(out) == []
    # data or checkpoints inside --out, --out inside the target: refused, nothing written
    assert main(args[:3] + [str(out / "notes.txt")] + args[4:] + ["--out", str(out), "--overwrite"]) == 2
    assert main(args + ["--out", str(target_with_tokenizer / "draft")]) == 2
    assert main(args + ["--out", str(tmp_path / "d2"), "--ckpt-dir", str(tmp_path / "d2" / "ck")]) == 2
    capsys.readouterr()
    assert tree_digest(out) == before and not (target_with_tokenizer / "draft").exists()
    fresh = tmp_path / "fresh"
    assert main(args + ["--out", str(fresh)]) == 0
    assert (fresh / "checkpoints").is_dir() and verify_manifest(fresh)["tool"] == "diffspec_jax.train_draft"
    assert siblings(fresh) == []
    from diffspec_jax import load_draft, load_target

    load_draft(fresh, load_target(target_with_tokenizer, "float32"))  # verifies the manifest
    # --ckpt-dir is checked before anything is written: another run's settings, fewer --steps than it holds,
    # folders named like steps that are no checkpoints (issue 38)
    ck, foreign = tmp_path / "ck", tmp_path / "foreign"
    shutil.copytree(fresh / "checkpoints", ck)
    for step in "123":
        user_dir(foreign / step)
    before, theirs = tree_digest(ck), tree_digest(foreign)
    capsys.readouterr()
    vocab = args.index("--draft-vocab") + 1
    for extra, needle in (((args[:vocab] + ["32"] + args[vocab + 1:]), "(--draft-vocab): 64 there, 32 here"),
                          (args + ["--steps", "1"], "at step 2, past the 1 steps asked for"),
                          (args + ["--rope-theta", "5e5"], "(--rope-theta): 10000.0 there, 500000.0 here"),
                          (args + ["--ckpt-dir", str(foreign)], "holds 3/, named like a training step")):
        ckpt = [] if "--ckpt-dir" in extra else ["--ckpt-dir", str(ck)]
        assert main(extra + ckpt + ["--out", str(tmp_path / "again")]) == 2
        assert needle in one_line_error(capsys.readouterr().err)
        assert not (tmp_path / "again").exists() and siblings(tmp_path / "again") == []
    assert tree_digest(ck) == before and tree_digest(foreign) == theirs
    # the same settings and --steps: nothing left to train, the checkpoint is exported (a record written before
    # --rope-theta existed meant the default base)
    record = ck / "diffspec_train_draft.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "rope_theta"}))
    assert main(args + ["--ckpt-dir", str(ck), "--out", str(tmp_path / "again")]) == 0
    assert "already held every step" in capsys.readouterr().out
    load_draft(tmp_path / "again", load_target(target_with_tokenizer, "float32"))


# ------------------------------------------------------------------------------------------ demo build
def test_build_checks_every_setting_before_touching_out(tmp_path, capsys):
    from diffspec_jax.demo.build import main
    from diffspec_jax.errors import ConfigError
    from diffspec_jax.validation import run_main

    out = tmp_path / "out"
    before = user_dir(out)
    for bad, needle in ((["--eval-prompts", "0"], "--eval-prompts must be an integer >= 1"),
                        (["--vocab", "100"], "--vocab must be an integer >= 258"),
                        (["--draft-vocab", "5000"], r"--draft-vocab must be an integer in \[1, 4096\]"),
                        (["--contexts", "2k"], "--contexts wants"), (["--workloads", "chat"], "--workloads entry"),
                        (["--k", "0"], "--k must be"), (["--budget", "100"], "multiple of diffspec_chunk_size"),
                        (["--extra-packages", "no_such_package_x"], "not an installed package"),
                        (["--recall-fraction", "2"], "recall_fraction")):
        with pytest.raises(ConfigError, match=needle):
            main(["--out", str(out)] + bad)
        assert tree_digest(out) == before
    with pytest.raises(OutputDirError, match="not empty"):  # valid settings: the non-empty --out is refused
        main(["--out", str(out), "--max-files", "3"])
    assert tree_digest(out) == before and siblings(out) == []
    # as `python -m diffspec_jax.demo.build`: one line, exit status 2
    assert run_main(main, ["--out", str(out), "--eval-prompts", "0"]) == 2
    assert "--eval-prompts" in one_line_error(capsys.readouterr().err)
    with pytest.raises(SystemExit) as info:
        main(["--out", str(out), "--k", "x"])
    assert info.value.code == 2 and "invalid int value" in one_line_error(capsys.readouterr().err)
    assert tree_digest(out) == before and os.listdir(tmp_path) == ["out"]
