"""`opband import msprobe|polygraphy`: real dumps made by the tools themselves, compared against
opband's own capture of the same model, and hostile files refused."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import accuracy
from accuracy.bundle import Bundle
from hooks import capture
from hooks.peers import PeerDumpError, import_msprobe, import_polygraphy
from hooks.peers.msprobe import parse_api_name, parse_module_name, torch_name

OPBAND = str(Path(sys.executable).with_name("opband"))
SMALL = "DecoderConfig(layers=2, dim=32, heads=2, hidden=48, seq=8, vocab=64)"
MSPROBE_RUN = f"""
import sys, torch
from msprobe.pytorch import PrecisionDebugger
from hooks.demo_model import DecoderConfig, build
model, (ids,) = build({SMALL})
debugger = PrecisionDebugger(task=sys.argv[2], dump_path=sys.argv[3], level=sys.argv[1])
debugger.start(model)
with torch.no_grad():
    model(ids)
debugger.stop()
debugger.step()
"""
CASES = [("L0", "tensor"), ("mix", "tensor"), ("mix", "statistics"), ("L1", "tensor")]


@pytest.fixture(scope="module")
def msprobe_dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """Real msprobe dumps of the small demo decoder on CPU (one subprocess each: msprobe patches torch)."""
    pytest.importorskip("msprobe", reason="mindstudio-probe is in the test extra: pip install -e '.[test]'")
    root = tmp_path_factory.mktemp("msprobe")
    script = root / "run.py"
    script.write_text(MSPROBE_RUN)
    procs = {case: subprocess.Popen([sys.executable, str(script), *case, str(root / "-".join(case))],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=root) for case in CASES}
    for case, proc in procs.items():
        out = proc.communicate(timeout=300)[0].decode(errors="replace")
        assert proc.returncode == 0, f"msprobe {case} failed:\n{out[-3000:]}"
    return {case: root / "-".join(case) for case in CASES}


@pytest.fixture(scope="module")
def opband_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """opband's own api-level capture of the same model (same seed, same weights)."""
    from hooks.demo_model import DecoderConfig, build  # noqa: F401 - used by SMALL

    model, (ids,) = eval(f"build({SMALL})")
    out = tmp_path_factory.mktemp("capture") / "api.bundle"
    with torch.no_grad(), capture(model, out, level="api", progress=False):
        model(ids)
    return out


@pytest.mark.parametrize("level,task", CASES[:3], ids=["L0-tensor", "mix-tensor", "mix-statistics"])
def test_msprobe_dump_aligns_with_opbands_capture(msprobe_dumps, opband_capture, tmp_path, level, task) -> None:  # noqa: ANN001
    bundle = import_msprobe(msprobe_dumps[(level, task)], tmp_path / "msprobe.bundle")
    imported = Bundle.open(bundle)
    assert imported.manifest.run["imported_from"]["level"] == level
    assert all((r.tensor is not None) == (task == "tensor") for r in imported.records)
    report = accuracy.compare(opband_capture, bundle)
    measured = [o for o in report.ops if o.metrics is not None]
    assert {o.aligned_by for o in measured} == {"key"}, "imported records take opband's op keys"
    assert {o.verdict for o in measured} == {"pass"}, [(o.id, o.reason) for o in measured if o.verdict != "pass"]
    kinds = Counter(o.kind for o in measured)
    assert kinds["module"] == 2 * 13 + 4, kinds  # every module output: per layer 13; embed, norm, model, lm_head
    unpaired = {u.record.module for u in report.unmatched if u.side == "target"}
    if level == "L0":
        assert not unpaired and set(kinds) == {"module"}
    else:
        # msprobe's dump.json leaves out calls its construct.json lists (arange, cat, triu, casts): ops pair by
        # position inside a module, so past such a gap the module's output record is the comparison
        assert unpaired <= {"model", "model.layers.0.self_attn", "model.layers.1.self_attn"}, unpaired
        assert kinds["api"] >= 40 and "model.layers.1.mlp.down_proj/torch.nn.functional.linear#0" in {o.key for o in measured}
        assert "model.layers.1.input_layernorm/torch.rsqrt#0" in {o.key for o in measured}
        assert "model/torch.Tensor.__rtruediv__#0" in {r.key for r in imported.records}, "reciprocal + __mul__ = scalar / t"
    if task == "tensor":
        assert max(o.metrics.max_abs for o in measured) == 0.0, "both are the fp32 CPU run: bitwise equal"
    else:  # msprobe's statistics of the masked scores include -inf: left out and said so
        assert any("not comparable" in d.message for d in imported.manifest.diagnostics)


def test_msprobe_l1_keeps_its_names_and_finds_a_changed_op(msprobe_dumps, tmp_path) -> None:  # noqa: ANN001
    dump = msprobe_dumps[("L1", "tensor")]
    ref = import_msprobe(dump, tmp_path / "ref.bundle")
    keys = [r.key for r in Bundle.open(ref).records]
    assert "msprobe/Functional.linear#0" in keys and "msprobe/Functional.silu#1" in keys
    # a target dump whose second SiLU output lost precision (rounded through bf16): found by name
    broken = tmp_path / "broken"
    shutil.copytree(dump, broken)
    silu = next(broken.rglob("Functional.silu.1.forward.output.0.pt"))
    torch.save(torch.load(silu, weights_only=True).bfloat16().float(), silu)
    report = accuracy.compare(ref, import_msprobe(broken, tmp_path / "t.bundle"))
    assert [o.key for o in report.ops if o.verdict == "fail"] == ["msprobe/Functional.silu#1"]


def test_names() -> None:
    assert parse_module_name("Module.model.layers.0.mlp.down_proj.Linear.forward.3") == \
        ("model.layers.0.mlp.down_proj", "Linear", "forward", 3)
    assert parse_api_name("Tensor.__mul__.12.forward") == ("Tensor", "__mul__", "forward", 12)
    assert torch_name("Tensor", "__truediv__") == "torch.Tensor.div"
    assert torch_name("Functional", "linear") == "torch.nn.functional.linear"
    assert parse_module_name("Functional.linear.0.forward") is None


def _dump(folder: Path, data_name: str, task: str = "tensor") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dump_tensor_data").mkdir(exist_ok=True)
    entry = {"input_args": [], "input_kwargs": {}, "output": [
        {"type": "torch.Tensor", "dtype": "torch.float32", "shape": [2], "Max": 1.0, "Min": 0.0, "Mean": 0.5,
         "Norm": 1.0, "requires_grad": False, "data_name": data_name}]}
    (folder / "dump.json").write_text(json.dumps({"task": task, "level": "L1", "framework": "pytorch",
                                                  "dump_data_dir": "/elsewhere", "data": {"Torch.relu.0.forward": entry}}))
    return folder


class _Evil:
    def __reduce__(self):  # noqa: ANN204
        return (os.system, ("touch PWNED",))


def test_hostile_msprobe_files_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ok = _dump(tmp_path / "ok", "t.pt")
    torch.save(torch.tensor([0.0, 1.0]), ok / "dump_tensor_data" / "t.pt")
    b = Bundle.open(import_msprobe(ok, tmp_path / "ok.bundle"))
    assert [r.key for r in b.records] == ["msprobe/Torch.relu#0"] and b.record_values(b.records[0].id).tolist() == [0, 1]

    cases = {
        "pickle": ("t.pt", lambda p: torch.save({"x": _Evil()}, p), "restricted (weights_only) loader"),
        "legacy": ("t.pt", lambda p: p.write_bytes(b"\x80\x04K\x01."), "not a torch.save zip archive"),
        "dict": ("t.pt", lambda p: torch.save({"w": torch.ones(2)}, p), "holds a dict, not a plain tensor"),
        "object-npy": ("t.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True),
                       "object arrays and pickles are refused"),
        "traversal": ("../t.pt", None, "not a plain .pt/.npy file name"),
        "other-suffix": ("t.pkl", None, "not a plain .pt/.npy file name"),
        "missing": ("gone.pt", None, "is missing"),
    }
    for name, (data_name, write, message) in cases.items():
        folder = _dump(tmp_path / name, data_name)
        if write is not None:
            write(folder / "dump_tensor_data" / data_name)
        with pytest.raises(PeerDumpError, match=message.replace("(", r"\(").replace(")", r"\)")):
            import_msprobe(folder, tmp_path / f"{name}.bundle")
        assert not (tmp_path / f"{name}.bundle").exists()
    assert not (tmp_path / "PWNED").exists(), "the pickle's payload must never run"

    link = _dump(tmp_path / "link", "t.pt")
    (link / "dump_tensor_data" / "t.pt").symlink_to(ok / "dump_tensor_data" / "t.pt")
    with pytest.raises(PeerDumpError, match="symbolic link"):
        import_msprobe(link, tmp_path / "link.bundle")
    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / "dump.json").write_text('{"task": "tensor", "task": "statistics", "data": {}}')
    with pytest.raises(PeerDumpError, match="repeats a key"):
        import_msprobe(dup, tmp_path / "dup.bundle")
    (dup / "dump.json").write_text('{"task": "overflow_check", "data": {}}')
    with pytest.raises(PeerDumpError, match="import a 'tensor' or 'statistics' dump"):
        import_msprobe(dup, tmp_path / "dup.bundle")
    r = subprocess.run([OPBAND, "import", "msprobe", str(tmp_path / "pickle"), "-o", str(tmp_path / "x.bundle")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


ONNX_MODEL = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
torch.onnx.export(model, (torch.randn(2, 8),), sys.argv[1], dynamo=False, input_names=["x"])
torch.save(model.state_dict(), sys.argv[2])
"""


def test_polygraphy_run_results(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="onnxruntime and polygraphy are in the test extra")
    polygraphy = Path(sys.executable).with_name("polygraphy")
    (tmp_path / "export.py").write_text(ONNX_MODEL)
    subprocess.run([sys.executable, "export.py", "m.onnx", "w.pt"], cwd=tmp_path, check=True, capture_output=True,
                   timeout=300)
    np.save(tmp_path / "x.npy", np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8))
    (tmp_path / "data.py").write_text("import numpy as np\ndef load_data():\n    yield {'x': np.load('x.npy')}\n")
    r = subprocess.run([str(polygraphy), "run", "m.onnx", "--onnxrt", "--onnx-outputs", "mark", "all",
                        "--data-loader-script", "data.py", "--save-outputs", "out.json"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    bundle = Bundle.open(import_polygraphy(tmp_path / "out.json", tmp_path / "pg.bundle"))
    assert bundle.manifest.run["target"] == "onnxrt-runner"
    by_key = {rec.key: rec for rec in bundle.records}
    assert set(by_key) >= {"0/onnx.Gemm#0", "1/onnx.Gelu#0"}
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    x = torch.from_numpy(np.load(tmp_path / "x.npy"))
    with torch.no_grad():
        hidden = model[0](x)
    np.testing.assert_allclose(bundle.record_values("0/onnx.Gemm#0"), hidden.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bundle.record_values("1/onnx.Gelu#0"), model[1](hidden).numpy(), rtol=1e-5, atol=1e-6)
    assert accuracy.compare(bundle.path, bundle.path).verdict == "pass"
    cli = subprocess.run([OPBAND, "import", "polygraphy", str(tmp_path / "out.json"), "-o", str(tmp_path / "cli.bundle")],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and cli.stdout.startswith(f"wrote {tmp_path / 'cli.bundle'} (3 records"), cli.stderr

    data = json.loads((tmp_path / "out.json").read_text())
    out = data["lst"][0][1][0]["outputs"]
    name = next(iter(out))
    out[name]["values"] = {"tensor": base64.b64encode(b"\x80\x04.").decode(), "polygraphy_class": "Tensor"}
    (tmp_path / "tensor.json").write_text(json.dumps(data))
    with pytest.raises(PeerDumpError, match="torch tensors in the JSON are torch.save pickles"):
        import_polygraphy(tmp_path / "tensor.json", tmp_path / "t.bundle")
    buf = io.BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    out[name]["values"] = {"array": base64.b64encode(buf.getvalue()).decode(), "polygraphy_class": "ndarray"}
    (tmp_path / "obj.json").write_text(json.dumps(data))
    with pytest.raises(PeerDumpError, match="object arrays and pickles are refused"):
        import_polygraphy(tmp_path / "obj.json", tmp_path / "o.bundle")
    with pytest.raises(PeerDumpError, match="has no runner 'trt'"):
        import_polygraphy(tmp_path / "out.json", tmp_path / "x.bundle", runner="trt")
    with zipfile.ZipFile(tmp_path / "z.json", "w") as z:
        z.writestr("a", "b")
    with pytest.raises(PeerDumpError, match="not valid JSON"):
        import_polygraphy(tmp_path / "z.json", tmp_path / "z.bundle")
