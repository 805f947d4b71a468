"""Layout is data: records carry strides and memory format; channels-last vs contiguous compares by
logical index and the report says the layouts differed."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import accuracy
from accuracy.bundle import Bundle
from accuracy.report import to_dict, to_text
from hooks import capture


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _run(model: nn.Module, x: torch.Tensor, path: Path) -> Bundle:
    with torch.no_grad(), capture(model, path, progress=False):
        model(x)
    return Bundle.open(path)


def test_channels_last_records_layout_and_compares_by_logical_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    x = torch.randn(2, 3, 8, 8)
    ref = _run(model, x, tmp_path / "ref.bundle")
    cl = _run(model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last),
              tmp_path / "cl.bundle")
    conv_ref, conv_cl = ref.record("conv/forward#0"), cl.record("conv/forward#0")
    assert conv_ref.memory_format is None and conv_ref.layout == "contiguous"
    assert conv_cl.memory_format == "channels_last" and conv_cl.strides == [512, 1, 64, 8]
    # stored in logical order: the values are those of the NCHW tensor, index by index
    with torch.no_grad():
        expected = model.conv(x.to(memory_format=torch.channels_last))
    assert torch.equal(torch.from_numpy(cl.record_values("conv/forward#0").copy()), expected.contiguous())
    report = accuracy.compare(ref, cl)
    assert report.verdict == "pass"  # a layout is not an error
    conv = next(o for o in report.ops if o.id == "conv/forward#0")
    assert conv.layouts == ("contiguous", "channels_last") and "layouts differed" in conv.reason
    fc = next(o for o in report.ops if o.id == "fc/forward#0")
    assert fc.layouts is None
    assert "ops had different memory layouts (contiguous -> channels_last)" in to_text(report)
    assert to_dict(report)["ops"][0].keys() >= {"layouts"}


def test_transposed_output_records_its_strides(tmp_path: Path) -> None:
    class T(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * 2).t()

    b = _run(T(), torch.arange(6.0).reshape(2, 3), tmp_path / "t.bundle")
    root = b.record("/forward#0")
    assert root.memory_format == "strided" and root.strides == [1, 3] and root.layout == "strided [1, 3]"
    assert b.record_values("/forward#0").tolist() == [[0, 6], [2, 8], [4, 10]]  # type: ignore[union-attr]
