"""The bundle manifest schema: run metadata, environment and one record per tensor.

Format 1.x keeps the records in the manifest; format 2.0 keeps them as JSON lines in a tensor of
the bundle (``RecordsRef`` says which, and how many), so a bundle may hold millions of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from accuracy.errors import BundleError
from accuracy.strictjson import loads_strict

FORMAT_NAME = "opband.bundle"
FORMAT_VERSION = "2.0"
SUPPORTED_MAJOR = 2
#: the newest minor version this reader knows, per major version it reads (1.x: records in the manifest)
KNOWN_MINOR = {1: 2, 2: 0}

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
    key: str = Field(max_length=4096, description="op key: module path + '/' + op + '#' + ordinal")
    output: int = 0
    module: str = Field(max_length=4096)
    op: str = Field(max_length=4096)
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


class TensorPrint(BaseModel):
    """A tensor's fingerprint: a digest of its bytes, and statistics that survive an honest dtype cast."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")
    shape: list[int]
    dtype: str
    digest: str
    sum: float
    l2: float
    absmax: float
    nonfinite: int = 0


class Fingerprints(BaseModel):
    """The run's model inputs (first call of the captured model) and its parameters and buffers (since 1.2)."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="strings")
    inputs: dict[str, TensorPrint] = Field(default_factory=dict)
    parameters: dict[str, TensorPrint] = Field(default_factory=dict)


class Diagnostic(BaseModel):
    """A capture problem that did not interrupt the user's run."""

    key: str | None = None
    message: str


#: a target name: what a series of runs is kept under, e.g. ``ascend-910b/bf16``, ``cuda-h100/fp32``
TARGET_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+:@/-]*$"
#: a tag key, e.g. ``branch``, ``commit``, ``cann``, ``driver``, ``op-library``
TAG_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
MAX_TAGS = 64


class RunNames(BaseModel):
    """What a person calls a run (``run.label``, ``run.target``, ``run.tags`` in the manifest): a label, the
    target name its drift series and regressions are kept under, and free-form ``key=value`` tags."""

    model_config = ConfigDict(extra="forbid")
    label: str | None = Field(default=None, min_length=1, max_length=200, description="e.g. nightly-2026-12-01")
    target: str | None = Field(default=None, min_length=1, max_length=200, pattern=TARGET_PATTERN,
                               description="e.g. ascend-910b/bf16; default: variant@device")
    tags: dict[str, str] = Field(default_factory=dict, description="e.g. branch, commit, cann, driver, op-library")

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: dict[str, str]) -> dict[str, str]:
        import re

        if len(v) > MAX_TAGS:
            raise ValueError(f"{len(v)} tags; at most {MAX_TAGS}")
        for key, value in v.items():
            if len(key) > 64 or not re.match(TAG_KEY_PATTERN, key):
                raise ValueError(f"tag key {key[:80]!r}: use letters, digits, '.', '_' and '-' (at most 64)")
            if len(value) > 500:
                raise ValueError(f"tag {key!r}: value longer than 500 characters")
        return v

    def target_or_default(self, variant: str, device: str) -> str:
        """The target name, or ``variant@device`` when the run was given none."""
        return self.target or f"{variant}@{device}"


def parse_tags(items: list[str] | None) -> dict[str, str]:
    """``["branch=main", "cann=8.0.RC2"]`` -> ``{"branch": "main", "cann": "8.0.RC2"}``; a ValueError
    saying the expected form for an item without ``=``."""
    tags: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"tag {item!r} must be KEY=VALUE, e.g. --tag branch=main --tag cann=8.0.RC2")
        tags[key.strip()] = value.strip()
    return tags


def run_names(label: str | None = None, target: str | None = None, tags: list[str] | dict[str, str] | None = None,
              ) -> RunNames:
    """Validated names from flags or query parameters; a ValueError with one readable sentence."""
    try:
        return RunNames(label=label or None, target=target or None,
                        tags=tags if isinstance(tags, dict) else parse_tags(tags))
    except ValidationError as e:
        raise ValueError(_names_error(e)) from None


def _names_error(e: ValidationError) -> str:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "names"
    msg = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "string_pattern_mismatch":
        msg = "use letters, digits and . _ + : @ / -, starting with a letter or digit, e.g. ascend-910b/bf16"
    return f"run {where} {str(first.get('input'))[:80]!r}: {msg}" if where != "tags" else f"run tags: {msg}"


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
    fingerprints: Fingerprints | None = None

    @field_validator("format_version")
    @classmethod
    def _version(cls, v: str) -> str:
        major = v.split(".", 1)[0]
        if not major.isdigit() or int(major) not in KNOWN_MINOR:
            raise ValueError(
                f"bundle format version {v!r} is not supported (this reader reads "
                f"{', '.join(f'{m}.x' for m in KNOWN_MINOR)}); upgrade opband to read it"
            )
        return v

    @property
    def names(self) -> RunNames:
        """The run's label, target name and tags (``run.label``, ``run.target``, ``run.tags``)."""
        return self.names_with(None)

    def names_with(self, override: RunNames | None) -> RunNames:
        """The run's names with ``override``'s label and target where set and its tags on top. A label
        of another type or length (older writers) is read as text cut to 200 characters; a malformed
        target name (not overridden) or tags raise :class:`BundleError` saying what is wrong."""
        label = self.run.get("label")
        fields: dict[str, Any] = {"label": str(label)[:200] if label not in (None, "") else None}
        fields.update({k: self.run[k] for k in ("target", "tags") if k in self.run})
        if override is not None:
            fields["label"] = override.label or fields["label"]
            fields["target"] = override.target or fields.get("target")
            if override.tags:
                tags = fields.get("tags")
                fields["tags"] = {**(tags if isinstance(tags, dict) else {}), **override.tags}
        try:
            return RunNames.model_validate(fields)
        except ValidationError as e:
            raise BundleError(f"manifest {_names_error(e)}") from None

    @property
    def target(self) -> str:
        """The target name the run's series are kept under: ``run.target``, else ``variant@device``."""
        return self.names.target_or_default(self.variant, self.device)

    @property
    def variant(self) -> str:
        return str(self.run.get("variant", "fp32"))

    @property
    def device(self) -> str:
        return str(self.run.get("device", "cpu"))


def shape_signature(shapes: list[list[int] | None]) -> str:
    return ",".join("-" if s is None else "x".join(map(str, s)) or "scalar" for s in shapes)


SUPPORTED_MINOR = KNOWN_MINOR[SUPPORTED_MAJOR]


def _major(version: Any) -> int | None:
    head = str(version).split(".", 1)[0]
    return int(head) if head.isdigit() else None


def newer_minor(version: Any) -> bool:
    """A version of a major this reader knows, with a newer minor: unknown fields are ignored."""
    parts = str(version).split(".")
    return (len(parts) == 2 and all(p.isdigit() for p in parts) and int(parts[0]) in KNOWN_MINOR
            and int(parts[1]) > KNOWN_MINOR[int(parts[0])])


def _keep_known(d: Any, model: type[BaseModel]) -> Any:
    return {k: v for k, v in d.items() if k in model.model_fields} if isinstance(d, dict) else d


def _drop_unknown_record_fields(r: Any) -> Any:
    r = _keep_known(r, Record)
    if isinstance(r, dict) and isinstance(r.get("stats"), dict):
        r["stats"] = _keep_known(r["stats"], Stats)
    return r


def _drop_unknown_fields(data: dict[str, Any]) -> dict[str, Any]:
    """A newer minor version may add optional fields: readers ignore them (docs/bundle-format.md)."""
    out = _keep_known(data, Manifest)
    if isinstance(out.get("records"), list):
        out["records"] = [_drop_unknown_record_fields(r) for r in out["records"]]
    return out


class RecordsRef(BaseModel):
    """Format 2.0: where a bundle's records are (``manifest.records``): a U8 tensor of JSON lines."""

    model_config = ConfigDict(extra="forbid")
    tensor: str = Field(min_length=1, max_length=4096)
    count: int = Field(ge=0)


def _schema_error(e: ValidationError, what: str) -> BundleError:
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return BundleError(f"{what} field {where or '(root)'}: {first['msg']} ({e.error_count()} problem(s) in all)")


def parse_manifest_head(text: str) -> tuple[Manifest, RecordsRef | None]:
    """Parse manifest JSON. 1.x: the Manifest with its records, and None. 2.x: the Manifest without
    records, and where they are (``{"tensor": ..., "count": ...}`` in place of the record list)."""
    data = loads_strict(text, "manifest")
    ref: RecordsRef | None = None
    if isinstance(data, dict) and _major(data.get("format_version")) == 2:
        raw = data.pop("records", None)
        if not isinstance(raw, dict):
            raise BundleError("manifest field records: a format 2 manifest names its records tensor "
                              '({"tensor": NAME, "count": N}), it does not list them')
        try:
            ref = RecordsRef.model_validate(raw)
        except ValidationError as e:
            raise _schema_error(e, "manifest records") from None
    if isinstance(data, dict) and newer_minor(data.get("format_version")):
        data = _drop_unknown_fields(data)
    try:
        return Manifest.model_validate(data), ref
    except ValidationError as e:
        raise _schema_error(e, "manifest") from e


#: ``Record.model_validate_json`` and ``model_dump_json`` (as bytes) without their wrappers' per-call cost
_RECORD_JSON = Record.__pydantic_validator__.validate_json
_RECORD_DUMP = Record.__pydantic_serializer__.to_json


def parse_record(line: bytes | str, newer: bool = False, where: str = "record") -> Record:
    """One record from its JSON (format 2.0: one line of the records tensor), strict JSON as for the
    manifest; ``newer``: the bundle's minor version is newer than this reader's (unknown fields dropped).

    A line exactly as opband writes it (``model_dump_json(exclude_none=True)`` of what it parses to) is
    strict JSON by construction: it is parsed in one call; any other line takes the strict path."""
    if not newer:
        try:
            record = _RECORD_JSON(line)
        except ValidationError:
            pass  # the strict path below says what is wrong
        else:
            dumped = _RECORD_DUMP(record, exclude_none=True)  # bytes
            if dumped == line if isinstance(line, bytes) else dumped.decode() == line:
                return record
    data = loads_strict(line, where)
    if not isinstance(data, dict):
        raise BundleError(f"{where} must be a JSON object")
    if newer:
        data = _drop_unknown_record_fields(data)
    try:
        return Record.model_validate(data)
    except ValidationError as e:
        raise _schema_error(e, where) from None
