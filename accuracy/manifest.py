"""The bundle manifest schema (version 1): run metadata, environment and one record per tensor."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from accuracy.errors import BundleError
from accuracy.strictjson import loads_strict

FORMAT_NAME = "opband.bundle"
FORMAT_VERSION = "1.2"
SUPPORTED_MAJOR = 1

RecordKind = Literal["module", "aten", "api", "grad"]


class Stats(BaseModel):
    """On-device statistics of one tensor (summary mode, and alongside tensors in full mode)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")
    numel: int
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    std: float | None = None
    l2: float | None = None
    absmax: float | None = None
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    sample: list[float] | None = None


class Record(BaseModel):
    """One captured tensor: an output (or input) of one op call."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")
    key: str = Field(description="op key: module path + '/' + op + '#' + ordinal")
    output: int = 0
    module: str
    op: str
    ordinal: int = 0
    kind: RecordKind = "aten"
    index: int = Field(description="execution order of the op call")
    input_shapes: list[list[int] | None] = Field(default_factory=list)
    input_dtypes: list[str | None] = Field(default_factory=list)
    shape: list[int]
    dtype: str
    tensor: str | None = None
    input_tensors: list[str | None] | None = None
    stats: Stats | None = None
    qparams: dict[str, Any] | None = None
    step: int = 0
    strides: list[int] | None = None  # 1.2: the output's strides when it is not contiguous (values stay logical)
    memory_format: str | None = None  # 1.2: "channels_last", "channels_last_3d" or "strided"; None = contiguous

    @property
    def id(self) -> str:
        """Unique within a bundle: the op key, plus ``:N`` for output N > 0."""
        return self.key if self.output == 0 else f"{self.key}:{self.output}"

    @property
    def layout(self) -> str:
        """``contiguous``, ``channels_last`` … or ``strided [s0, s1]``: how the output lay in memory."""
        if self.memory_format is None:
            return "contiguous"
        return f"strided {self.strides}" if self.memory_format == "strided" else self.memory_format

    @property
    def shape_signature(self) -> str:
        """Input shapes as one string, e.g. ``2x8x64,64x64`` (``-`` for non-tensor inputs)."""
        return shape_signature(self.input_shapes)

    @field_validator("key", "module", "op")
    @classmethod
    def _bounded(cls, v: str) -> str:
        if len(v) > 4096:
            raise ValueError("longer than 4096 characters")
        return v


class Diagnostic(BaseModel):
    """A capture problem that did not interrupt the user's run."""

    key: str | None = None
    message: str


class Manifest(BaseModel):
    """Everything about one capture run except the tensor bytes."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")
    format_version: str = FORMAT_VERSION
    created_at: str | None = None
    run: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    records: list[Record] = Field(default_factory=list)
    skipped_ops: dict[str, int] = Field(default_factory=dict)
    diagnostics: list[Diagnostic] = Field(default_factory=list)

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: str) -> str:
        major = v.split(".", 1)[0]
        if not major.isdigit() or int(major) != SUPPORTED_MAJOR:
            raise ValueError(
                f"bundle format version {v!r} is not supported (this reader reads {SUPPORTED_MAJOR}.x); "
                "upgrade opband to read it"
            )
        return v

    @property
    def variant(self) -> str:
        return str(self.run.get("variant", "fp32"))

    @property
    def device(self) -> str:
        return str(self.run.get("device", "cpu"))


def shape_signature(shapes: list[list[int] | None]) -> str:
    return ",".join("-" if s is None else "x".join(map(str, s)) or "scalar" for s in shapes)


SUPPORTED_MINOR = int(FORMAT_VERSION.split(".")[1])


def _newer_minor(version: Any) -> bool:
    parts = str(version).split(".")
    return (len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) == SUPPORTED_MAJOR
            and int(parts[1]) > SUPPORTED_MINOR)


def _drop_unknown_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A newer minor version may add optional fields: readers ignore them (docs/bundle-format.md)."""
    def keep(d: Any, model: type[BaseModel]) -> Any:
        return {k: v for k, v in d.items() if k in model.model_fields} if isinstance(d, dict) else d

    out = keep(data, Manifest)
    records = out.get("records")
    if isinstance(records, list):
        out["records"] = [keep(r, Record) for r in records]
        for r in out["records"]:
            if isinstance(r, dict) and isinstance(r.get("stats"), dict):
                r["stats"] = keep(r["stats"], Stats)
    return out


def parse_manifest(text: str) -> Manifest:
    """Parse manifest JSON, turning every schema problem into one readable BundleError."""
    data = loads_strict(text, "manifest")
    if isinstance(data, dict) and _newer_minor(data.get("format_version")):
        data = _drop_unknown_fields(data)
    try:
        return Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BundleError(f"manifest field {where or '(root)'}: {first['msg']} ({e.error_count()} problem(s) in all)") from e
