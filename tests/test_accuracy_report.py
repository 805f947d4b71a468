"""Golden-text tests: the exact output of every formatter for one small handcrafted report."""

from __future__ import annotations

import json

from accuracy import report
from accuracy.compare import ComparisonReport, OpResult
from accuracy.align import Unmatched
from accuracy.budgets import Budget
from accuracy.manifest import Record
from accuracy.metrics import Metrics

def small_report() -> ComparisonReport:
    b = Budget(3.05e-05, 0.999999998, "default float32/propagated")
    def m(nl2, mx, rel, cos, snr):
        return Metrics(numel=8, norm_l2=nl2, max_abs=mx, max_rel=rel, cosine=cos, snr_db=snr,
                       histogram=[2, 0, 1, 3, 2])
    ops = [
        OpResult(key="m.l0.mlp/aten.mm#0", output=0, op="aten.mm", module="m.l0.mlp", kind="aten", index=0,
                 input_shapes=[[2, 4], [4, 4]], shape=[2, 4], dtype="float32", reference_dtype="float32",
                 metrics=m(1e-7, 2e-7, 3e-7, 1.0, 140.0), verdict="pass",
                 reason="norm L2 err 1.0e-07 <= budget 3.1e-05 (default float32/propagated)", budget=b),
        OpResult(key="m.l1.act/aten.gelu#0", output=0, op="aten.gelu", module="m.l1.act", kind="aten", index=1,
                 input_shapes=[[2, 4]], shape=[2, 4], dtype="float32", reference_dtype="float32",
                 metrics=m(0.163, 0.25, 1.5, 0.9867, 15.75), verdict="fail",
                 reason="norm L2 err 1.6e-01 > budget 3.1e-05 (default float32/propagated)", budget=b),
        OpResult(key="m.l1.down/aten.mm#0", output=0, op="aten.mm", module="m.l1.down", kind="aten", index=2,
                 input_shapes=[[2, 4], [4, 4]], shape=[2, 4], dtype="float32", reference_dtype="float32",
                 metrics=m(0.05, 0.1, 0.4, 0.9988, 26.0), verdict="fail",
                 reason="norm L2 err 5.0e-02 > budget 3.1e-05 (default float32/propagated)", budget=b, inherited=True),
    ]
    extra = Record(key="m.l1.act/aten.mul#0", module="m.l1.act", op="aten.mul", index=3, shape=[2, 4], dtype="float32")
    un = [Unmatched(extra, "target", "no aten.mul at this position of module 'm.l1.act' on the other side")]
    ops.append(OpResult(key=extra.key, output=0, op=extra.op, module=extra.module, kind="aten", index=3,
                        input_shapes=[], shape=[2, 4], dtype="float32", reference_dtype="float32", metrics=None,
                        verdict="new", reason="only in the target: " + un[0].reason, aligned_by="none"))
    counts = {v: sum(o.verdict == v for o in ops) for v in ("pass", "new", "missing", "warn", "fail")}
    return ComparisonReport(reference={"path": "ref.bundle", "run": {"variant": "fp32"}, "records": 3},
                            target={"path": "tgt.bundle", "run": {"variant": "fp32"}, "records": 4},
                            mode="propagated", ops=ops, unmatched=un, first_divergence=ops[1], verdict="fail",
                            counts=counts)


TEXT = "                                            opband compare (propagated): fp32 vs fp32                                             \n┏━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━┳━━━━━━━━┳━━━━━━━━━━┓\n┃ verdict          ┃ op key               ┃ input shapes ┃ dtype   ┃  norm_l2 ┃  max_abs ┃  max_rel ┃ cosine ┃ snr_db ┃   budget ┃\n┡━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━╇━━━━━━━━╇━━━━━━━━━━┩\n│ FAIL             │ m.l1.act/aten.gelu#0 │ 2x4          │ float32 │    0.163 │     0.25 │      1.5 │ 0.9867 │  15.75 │ 3.05e-05 │\n│ FAIL (inherited) │ m.l1.down/aten.mm#0  │ 2x4,4x4      │ float32 │     0.05 │      0.1 │      0.4 │ 0.9988 │     26 │ 3.05e-05 │\n│ PASS             │ m.l0.mlp/aten.mm#0   │ 2x4,4x4      │ float32 │ 1.00e-07 │ 2.00e-07 │ 3.00e-07 │      1 │    140 │ 3.05e-05 │\n│ NEW              │ m.l1.act/aten.mul#0  │              │ float32 │        - │        - │        - │      - │      - │        - │\n└──────────────────┴──────────────────────┴──────────────┴─────────┴──────────┴──────────┴──────────┴────────┴────────┴──────────┘\nFAILED | m.l1.act/aten.gelu#0 | norm L2 err 1.6e-01 > budget 3.1e-05 (default float32/propagated)\nFAILED | fail | 4 ops: 1 pass, 1 new, 2 fail\nFAILED | first divergence: m.l1.act/aten.gelu#0 (op aten.gelu, module m.l1.act, input shapes 2x4) | norm L2 err 1.6e-01 > budget 3.1e-05 (default float32/propagated)\nNote: later failures marked 'inherited' carry this op's error downstream; re-run with `opband capture --replay` to measure each op on its own inputs.\n"

MARKDOWN = "## opband: FAIL\n\ntarget **fp32** vs reference **fp32**\n\n```\nFAILED | fail | 4 ops: 1 pass, 1 new, 2 fail\nFAILED | first divergence: m.l1.act/aten.gelu#0 (op aten.gelu, module m.l1.act, input shapes 2x4) | norm L2 err 1.6e-01 > budget 3.1e-05 (default float32/propagated)\nNote: later failures marked 'inherited' carry this op's error downstream; re-run with `opband capture --replay` to measure each op on its own inputs.\n```\n\n| verdict | op key | input shapes | dtype | norm_l2 | max_abs | max_rel | cosine | snr_db | budget | reason |\n|---|---|---|---|---|---|---|---|---|---|---|\n| fail | `m.l1.act/aten.gelu#0` | 2x4 | float32 | 0.163 | 0.25 | 1.5 | 0.9867 | 15.75 | 3.05e-05 | norm L2 err 1.6e-01 > budget 3.1e-05 (default float32/propagated) |\n| fail (inherited) | `m.l1.down/aten.mm#0` | 2x4,4x4 | float32 | 0.05 | 0.1 | 0.4 | 0.9988 | 26 | 3.05e-05 | norm L2 err 5.0e-02 > budget 3.1e-05 (default float32/propagated) |\n| pass | `m.l0.mlp/aten.mm#0` | 2x4,4x4 | float32 | 1.00e-07 | 2.00e-07 | 3.00e-07 | 1 | 140 | 3.05e-05 | norm L2 err 1.0e-07 <= budget 3.1e-05 (default float32/propagated) |\n| new | `m.l1.act/aten.mul#0` |  | float32 | - | - | - | - | - | - | only in the target: no aten.mul at this position of module 'm.l1.act' on the other side |\n\n1 unmatched record(s):\n\n- `m.l1.act/aten.mul#0` (target): no aten.mul at this position of module 'm.l1.act' on the other side\n"


def test_terminal_table_golden() -> None:
    assert report.to_text(small_report(), width=160) == TEXT


def test_markdown_golden() -> None:
    assert report.to_markdown(small_report()) == MARKDOWN


def test_headline_prefixes() -> None:
    lines = report.headline(small_report()).splitlines()
    assert lines[0] == "FAILED | fail | 4 ops: 1 pass, 1 new, 2 fail"
    assert lines[1].startswith("FAILED | first divergence: m.l1.act/aten.gelu#0 (op aten.gelu, module m.l1.act")
    rep = small_report()
    rep.verdict, rep.first_divergence = "pass", None
    assert report.headline(rep) == "PASSED | pass | 4 ops: 1 pass, 1 new, 2 fail"


def test_json_schema() -> None:
    d = json.loads(report.to_json(small_report()))
    assert d["schema"] == "opband.report/1" and d["verdict"] == "fail" and d["mode"] == "propagated"
    assert [o["key"] for o in d["ops"]] == ["m.l1.act/aten.gelu#0", "m.l1.down/aten.mm#0", "m.l0.mlp/aten.mm#0",
                                            "m.l1.act/aten.mul#0"]
    for o in d["ops"]:
        assert {"key", "op", "module", "input_shapes", "dtype", "metrics", "verdict", "reason", "inherited"} <= set(o)
    assert d["first_divergence"]["key"] == "m.l1.act/aten.gelu#0" and d["first_divergence"]["input_shapes"] == [[2, 4]]
    assert d["unmatched"] == [{"key": "m.l1.act/aten.mul#0", "output": 0, "op": "aten.mul", "module": "m.l1.act",
                               "side": "target", "reason": "no aten.mul at this position of module 'm.l1.act' on the other side"}]
    gelu = d["ops"][0]
    assert gelu["metrics"]["norm_l2"] == 0.163 and gelu["metrics"]["histogram"] == [2, 0, 1, 3, 2]
    assert gelu["budget"] == {"norm_l2": 3.05e-05, "cosine_min": 0.999999998, "source": "default float32/propagated"}
    assert d["ops"][1]["inherited"] is True and d["counts"] == {"pass": 1, "new": 1, "missing": 0, "warn": 0, "fail": 2}


def test_html_is_standalone_with_a_histogram_per_op() -> None:
    rep = small_report()
    rep.ops[0].key = "m.l1.act/<script>#0"
    page = report.to_html(rep)
    assert page.startswith("<!doctype html>") and "http" not in page
    assert "&lt;script&gt;" in page and page.count("<script>") == 1  # the key escaped; only the pager's script
    assert page.count('<svg width="240" height="40" class="hist"') == 3  # the three ops with metrics
    assert page.count("<rect ") == 3 * 4  # four non-empty slots each
    assert "FAILED | fail | 4 ops" in page


def test_html_names_both_runs_diffs_their_environment_and_holds_every_op() -> None:
    import dataclasses

    rep = small_report()
    rep.reference = {"path": "ref.bundle", "records": 3, "run": {"variant": "fp32", "device": "cuda:0", "label": "gpu-ref"},
                     "environment": {"torch": "2.13.0", "cuda": "12.4", "threads": 8}}
    rep.target = {"path": "tgt.bundle", "records": 4,
                  "run": {"variant": "bf16", "device": "npu:0", "label": "nightly-7", "target": "ascend-910b/bf16",
                          "tags": {"cann": "8.0.RC2"}},
                  "environment": {"torch": "2.13.0", "cann": "8.0.RC2", "threads": 8}}
    rep.ops = rep.ops + [dataclasses.replace(rep.ops[0], key=f"m.extra{i}/aten.mm#0", index=10 + i) for i in range(446)]
    page = report.to_html(rep)
    assert page.count("<tr class=") == 450 and "m.extra445/aten.mm#0" in page  # never cut at 200
    assert "ops, worst first: 450</h2>" in page and "var size = 200" in page  # paged by the script
    assert "target <b>nightly-7 (ascend-910b/bf16, bf16@npu:0)</b> vs reference <b>gpu-ref (fp32@cuda:0)</b>" in page
    assert "<th>tags</th><td>-</td><td>cann=8.0.RC2</td>" in page
    assert "environment diff: 4 changed, 2 the same" in page  # cann, cuda, run.device, run.variant
    for field in ("environment.cann", "environment.cuda", "run.device", "run.variant"):
        assert f"<code>{field}</code>" in page
    assert "<code>environment.torch</code>" not in page
    short = report.to_html(rep, limit=10)
    assert short.count("<tr class=") == 10 and "ops, worst first: 10 (the worst 10 of 450)</h2>" in short
