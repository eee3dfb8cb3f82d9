"""tools/retrieval_tables.py: passkey.py runs split across folders read as one comparison, on common prompts."""

import pytest

from rope_llama.inference.reporting import write_csv
from rope_llama.study.tables import read_csv
from tools.retrieval_tables import common_prompts, main


def trials_csv(folder, method, length, recalls, task="multivalue"):
    """A passkey.py trials.csv of `method` at `length`: one prompt per depth with the given recall."""
    rows = [
        {"task": task, "method": method, "length": length, "depth": depth, "trial": 0, "key": 11111,
         "answers": "11111 22222 33333 44444", "answer": " 11111.", "greedy_correct": 0, "greedy_recall": r,
         "greedy_miss": "incomplete", "rank_correct": 1, "first_margin": 1.0}
        for depth, r in zip((0.1, 0.4, 0.6, 0.9), recalls)
    ]  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    write_csv(folder / "trials.csv", rows)


def test_two_folders_and_a_reference_make_one_ranked_comparison(tmp_path, capsys):
    """rerope (folder a) and yarn (folder b) at 1024, none (in window) at 512. Folder b also holds ntk, stopped
    after three depths: depth 0.9 drops out of the 1024 comparison for every method, so rerope's recall is
    over 0.1 / 0.4 / 0.6 (0.5, 0.75, 0.5) and the pairs stay paired. A fourth folder answered rerope's prompts
    again: a's are kept."""
    trials_csv(tmp_path / "a", "rerope", 1024, (0.5, 0.75, 0.5, 1.0))
    trials_csv(tmp_path / "b", "yarn", 1024, (0.25, 0.25, 0.25, 0.25))
    rows = (tmp_path / "b" / "trials.csv").read_text().splitlines()
    (tmp_path / "b" / "trials.csv").write_text(
        "\n".join(rows + [r.replace("yarn", "ntk") for r in rows[1:4]]) + "\n"
    )
    trials_csv(tmp_path / "ref", "none", 512, (0.25, 0.25, 0.0, 0.25))
    trials_csv(tmp_path / "again", "rerope", 1024, (0.0, 0.0, 0.0, 0.0))  # the same prompts, read from a only
    out = tmp_path / "tables"
    main([f"out={out}", f"runs={tmp_path / 'a'},{tmp_path / 'b'},{tmp_path / 'ref'},{tmp_path / 'again'}"])
    printed = capsys.readouterr().out
    assert "4 prompts answered again in a later folder of runs= are read from the first" in printed
    assert "multivalue at 1024: 3 prompts answered by every method (of up to 4)" in printed
    assert "multivalue at 512: 4 prompts answered by every method (of up to 4)" in printed
    summary = (out / "summary.md").read_text()
    assert "| base/rerope | — | 58% [58%, 58%] |" in summary  # no 512 cell; (0.5 + 0.75 + 0.5) / 3 at 1024
    assert "| base/none | 19% [19%, 19%] | — |" in summary
    assert "multivalue (recall), base models, T = 1024, each method against the best:" in summary
    assert "| 1 | rerope | 0.5833 | best |" in summary
    assert (out / "retrieval_multivalue_recall_depths.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "paired_retrieval.csv").is_file() and (out / "retrieval.csv").is_file()


def test_common_prompts_keeps_each_cell_apart():
    """A prompt missing at one length does not drop the same (depth, trial) at another."""
    trials = [
        {"task": "passkey", "length": n, "method": m, "depth": d, "trial": 0}
        for n, m, d in ((512, "a", 0.1), (512, "b", 0.1), (512, "a", 0.5), (1024, "a", 0.5), (1024, "b", 0.5))
    ]
    kept, counts = common_prompts(trials)
    assert [(t["length"], t["method"], t["depth"]) for t in kept] == [(512, "a", 0.1), (512, "b", 0.1),
                                                                      (1024, "a", 0.5), (1024, "b", 0.5)]  # fmt: skip
    assert counts == {("passkey", 512): (1, 2), ("passkey", 1024): (1, 1)}


@pytest.mark.parametrize(
    "argv, says",
    [
        (["out=x"], "out=<directory> and runs=<folder>"),
        (["out=x", "runs=nowhere"], "no trials.csv in nowhere"),
        (["out=x", "runs=y", "colour=red"], "unknown options ['colour']"),
        (["tables"], "arguments are key=value"),
    ],
)
def test_bad_arguments_are_one_sentence_and_exit_2(argv, says, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2 and says in capsys.readouterr().err


def test_held_out_families_are_pooled_as_the_headline(tmp_path):
    """Two held-out families, one folder per method: each family keeps its own row and the pooled `heldout`
    row counts both families' prompts (rerope: 1, 1, 0, 0 and 1, 0, 0, 0 -> 3 of 8)."""
    for folder, method, correct in (("a", "rerope", (1, 1, 0, 0, 1, 0, 0, 0)), ("b", "yarn", (1,) * 8)):
        rows = [
            {"task": task, "method": method, "length": 1024, "depth": depth, "trial": 0, "key": 11111,
             "answer": " 11111.", "greedy_correct": c, "rank_correct": 1, "first_margin": 1.0}
            for (task, depth), c in zip([(t, d) for t in ("heldout_prose", "heldout_list") for d in (0.1, 0.4, 0.6, 0.9)], correct)
        ]  # fmt: skip
        (tmp_path / folder).mkdir()
        write_csv(tmp_path / folder / "trials.csv", rows)
    out = tmp_path / "tables"
    main([f"out={out}", f"runs={tmp_path / 'a'},{tmp_path / 'b'}"])
    accuracy = {(r["task"], r["method"]): r for r in read_csv(out / "retrieval.csv")}
    assert accuracy["heldout", "base/rerope"]["greedy_acc"] == 3 / 8
    assert (
        accuracy["heldout", "base/rerope"]["trials"] == 8
        and accuracy["heldout", "base/yarn"]["greedy_acc"] == 1
    )
    assert accuracy["heldout_prose", "base/rerope"]["greedy_acc"] == 1 / 2
