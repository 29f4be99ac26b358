"""``python -m diffspec_jax.generate`` (interim target-only version) against an independent greedy loop."""

import json

import numpy as np

from diffspec_jax import forward, generate, load_target


def test_default_run_is_labelled_random_and_matches_full_forward_greedy(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path))
    assert generate.main(["--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["random_weights"] is True and 1 <= len(out["ids"]) <= 12
    model = load_target(out["model"], dtype="float32")
    seq = list(out["prompt_ids"])
    for _ in range(len(out["ids"])):  # reference: recompute the whole sequence each token, no cache
        seq.append(int(np.argmax(np.asarray(forward(model, [seq]))[0, -1])))
    assert seq[len(out["prompt_ids"]):] == out["ids"]


def test_bad_prompt_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path))
    assert generate.main(["--prompt-ids", "1,2,99999"]) == 2
    assert "must lie in [0, 256)" in capsys.readouterr().err
