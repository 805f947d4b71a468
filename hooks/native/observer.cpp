// The aten level's compiled observer (hooks/observer.py, docs/capture.md): a thread-local
// at::RecordFunction callback that sees every dispatcher call of the capturing thread, picks the
// calls a Python TorchDispatchMode would see (the outermost call that is not decomposed by a
// CompositeImplicitAutograd kernel), and records their outputs' statistics without entering
// Python. The statistics come from accuracy.fused's numba kernel, called by address (a numba
// cfunc), so a row is the one the Python path computes; module outputs come from the Python
// forward hooks (record_module). Whatever this file does not summarise itself (quantized, complex,
// subclass, nested or accelerator tensors, a multi-threaded summary of a large tensor) goes to the
// Python recorder through `escape`, under the same key. Records leave as the JSON lines pydantic
// would write (drain_lines), in order with the recorder's own.
//
// Built at install time as hooks._observer (setup.py); nothing compiles at run time.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <structmember.h>

#ifdef OPBAND_CUDA  // setup.py, when torch has CUDA and nvcc is found: CUDA outputs are summarised here too
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#endif
#include "stats_cuda.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// The statistics row's layout is accuracy.capture_format's (STAT_FIELDS, SAMPLE_SIZE): start() receives
// the field names and the sample size and refuses a layout other than the one this file was built for.
constexpr int kStatFields = 10;  // len(accuracy.capture_format.STAT_FIELDS)
constexpr int kSample = 16;      // accuracy.capture_format.SAMPLE_SIZE
constexpr int kRow = kStatFields + kSample;

// accuracy.fused.ROW_CFUNC[dtype]: (values address, n, sample index address, k, cancel, out, out length)
using RowFn = void (*)(int64_t, int64_t, int64_t, int64_t, double, double*, int64_t);

struct OpInfo {
  int name = -1;         // index into State::names ("aten.mm", the overload packet)
  bool observed = false; // a dispatcher op (not a user scope)
  bool composite = false;  // hidden from the Python key when an autograd kernel runs first: decomposed by a
                           // CompositeImplicitAutograd kernel, or a hand-written autograd kernel that never
                           // calls below autograd
  bool skip = false;     // views, metadata, allocation: counted only
  bool mutates = false;  // writes into existing memory
  int64_t skipped = 0;   // calls counted as skipped
  int64_t backward = 0;  // calls seen inside a backward pass (skipped too)
  int64_t under_mode = 0;  // calls made under a tracer's mode (fake tensors): not the model's run
};

struct Call {  // one recorded op call (or module output): what its outputs' records share
  int module;
  int name;
  int kind;  // 0: an ATen op ("aten"), 1: a module's forward ("module")
  int64_t ordinal;
  int64_t step;
  int64_t in_at;  // its inputs in State::ints: per input tensor its dtype code, its dim, then its sizes
  int64_t n_in;
};

struct Out {  // one output tensor
  int64_t call;
  int output;
  int8_t dtype;
  bool has_row;
  int8_t layout;  // 0 contiguous, 1 channels_last, 2 channels_last_3d, 3 other strides (hooks.opcall.layout_of)
  int64_t shape_at;  // its shape in State::ints, then its strides when layout != 0
  int64_t ndim;
  std::array<double, kRow> row;
  std::string tensor;  // full mode: the name of the stored tensor its record gives (empty: none)
  int64_t device_row = -1;  // >= 0: its row is still on the CUDA device (State::device_chunks), read at the drain
};

// Where a summarised output's bytes live, for a module output that aliases it (a Linear's
// module output is the `_unsafe_view` of its `mm`): the row is reused, as StatsBatch does.
struct Where {
  const c10::StorageImpl* storage;
  int64_t offset;
  int64_t numel;
  int8_t dtype;
  bool operator==(const Where& o) const {
    return storage == o.storage && offset == o.offset && numel == o.numel && dtype == o.dtype;
  }
};

inline uint64_t mix(uint64_t h) { return h * 0x9E3779B97F4A7C15ull; }  // Fibonacci hashing: take the high bits

struct Seen {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;  // keeps the address from being reused while held
  std::array<double, kRow> row;
  std::string tensor;  // full mode: the tensor stored from this memory (Recorder.by_storage), or empty
};

// The rows summarised since the last in-place write, by where their bytes live: an open-addressing
// table (one cache line a lookup, the model's weights evict it between ops) over entries kept in
// insertion order; clear() is a new generation. Callers clear it past kMaxSeen entries (one more fits).
class SeenTable {
 public:
  static constexpr size_t kMaxSeen = 4096;
  SeenTable() : slots_(kSlots) { rows_.reserve(kMaxSeen + 1); }  // entries never move: Seen* stay valid
  size_t size() const { return rows_.size(); }
  bool empty() const { return rows_.empty(); }
  void clear() {
    rows_.clear();
    if (++gen_ == 0) {  // wrapped: no slot may look live
      std::fill(slots_.begin(), slots_.end(), Slot{});
      gen_ = 1;
    }
  }
  Seen* find(const Where& w) {
    for (size_t i = home(w);; i = (i + 1) & (kSlots - 1)) {
      const Slot& slot = slots_[i];
      if (slot.gen != gen_) return nullptr;
      if (slot.key == w) return &rows_[slot.index];
    }
  }
  Seen* insert_or_assign(const Where& w, Seen&& seen) {
    for (size_t i = home(w);; i = (i + 1) & (kSlots - 1)) {
      Slot& slot = slots_[i];
      if (slot.gen != gen_) {
        slot = Slot{w, static_cast<uint32_t>(rows_.size()), gen_};
        rows_.push_back(std::move(seen));
        return &rows_.back();
      }
      if (slot.key == w) {
        rows_[slot.index] = std::move(seen);
        return &rows_[slot.index];
      }
    }
  }

 private:
  static constexpr size_t kSlots = 8192;  // a power of two, twice kMaxSeen: probes stay short
  struct Slot {
    Where key{nullptr, 0, 0, 0};
    uint32_t index = 0;
    uint32_t gen = 0;  // live in generation gen_ only
  };
  static size_t home(const Where& w) {
    const uint64_t h = reinterpret_cast<uintptr_t>(w.storage) ^ mix(static_cast<uint64_t>(w.offset) + 1) ^
                       (static_cast<uint64_t>(w.numel) << 8) ^ static_cast<uint64_t>(w.dtype);
    return static_cast<size_t>(mix(h) >> 51);  // 13 bits: kSlots
  }
  std::vector<Slot> slots_;
  std::vector<Seen> rows_;
  uint32_t gen_ = 1;
};

// Call ordinals per (module, op) key, open addressing: one cache line a lookup, no allocation per key.
class OrdinalTable {
 public:
  OrdinalTable() : slots_(64) {}
  int64_t next(uint64_t key) {  // the key's ordinal, then counted
    if (used_ * 2 >= slots_.size()) grow();
    Slot& slot = at(key);
    if (slot.key != key) {
      slot.key = key;
      ++used_;
    }
    return slot.count++;
  }
  void restart() {  // every key numbered from 0 again (a new step), the keys kept
    for (Slot& slot : slots_) slot.count = 0;
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // no key: module and op index are never both 0xFFFFFFFF
  struct Slot {
    uint64_t key = kEmpty;
    int64_t count = 0;
  };
  Slot& at(uint64_t key) {
    const size_t mask = slots_.size() - 1;
    for (size_t i = static_cast<size_t>(mix(key) >> 40) & mask;; i = (i + 1) & mask)
      if (slots_[i].key == key || slots_[i].key == kEmpty) return slots_[i];
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const Slot& s : old)
      if (s.key != kEmpty) at(s.key) = s;
  }
  std::vector<Slot> slots_;
  size_t used_ = 0;
};

// Full mode: a tensor stored already, by the TensorImpl it came from (Recorder.stored): the same
// tensor at the same version is not stored again.
struct Stored {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl;
  int64_t version;
  std::string name;
};

// Full mode: a tensor to write, waiting for Python (take_writes) to hand it to the bundle writer.
struct Pending {
  std::string name;
  int8_t dtype;
  std::vector<int64_t> shape;
  at::Tensor values;  // contiguous (the output itself, or a contiguous copy of it)
};

// A contiguous tensor's bytes for Python (a read-only buffer: memoryview(held) is flat uint8), without
// a torch.Tensor or numpy array in between; the bundle writer keeps it until written.
struct HeldBytes {
  at::Tensor values;
};

// The records of a drain deferred inside the forward (drain_lines with `defer`), kept with their shapes
// until the capture's last drain (held_lines), when the device rows they name are home.
struct Held {
  std::vector<Call> calls;
  std::vector<Out> outs;
  std::vector<int64_t> ints;
  int64_t base;  // the index of its first record
  void trade();  // its records for State's (defined after State)
};

#ifdef OPBAND_CUDA
// A float32 buffer of kChunkRows device rows, allocated on `stream`. Another stream writes into it only
// after waiting for `made` (the allocation is ordered on `stream` alone: the block may have been another
// tensor's, still in use there), and records the buffer on itself, so freeing it waits for its launches.
struct DeviceChunk {
  at::Tensor rows;
  c10::Stream stream;
  c10::Event made{c10::DeviceType::CUDA};
  std::vector<c10::StreamId> joined;  // the other streams that waited for `made` and were recorded
};
#endif

struct State {
  bool installed = false;
  bool on = false;  // recording: the recorder is active and not busy
  int module = -1;  // innermost module path (index into the Python list of module names)
  int64_t step = 0;
  bool per_step = false;  // each step numbers its calls afresh, and its keys end in "@step" (step > 0)
  int64_t epoch = 0;
  int64_t ops_seen = 0;
  bool settle_pending = false;
  bool skip_no_number = true;
  int64_t parallel_min = 1 << 20;
  std::unordered_set<std::string> no_number;
  std::vector<std::string> names;
  std::unordered_map<std::string, int> name_index;
  std::unordered_map<const void*, OpInfo> ops;  // by the schema's overload-name address
  OrdinalTable ordinals;
  std::vector<Call> calls;
  std::vector<Out> outs;
  std::vector<int64_t> ints;  // the records' shapes (Call::in_at, Out::shape_at): no allocation per record
  // the statistics row's fields as they open in a record line (",\"min\":"), and whether each is a count
  std::array<std::string, kStatFields> stat_keys;
  std::array<bool, kStatFields> stat_count{};
  std::array<RowFn, 4> row_fn{};  // accuracy.capture_format.KERNEL_DTYPES: float32, float64, bfloat16, float16
  std::array<double, 4> cancel{};
  std::unordered_map<int64_t, at::Tensor> sample_index;
  std::vector<py::str> module_names;
  py::object settle;  // called (GIL held) before the first op that writes in place
  py::object escape;  // the Python recorder's path for an op this file does not summarise
  at::CallbackHandle handle = 0;
  SeenTable seen;  // rows since the last in-place write
  // full mode (Recorder._store's rules): tensors stored so far, and those Python has not taken yet
  bool full = false;
  std::vector<std::string> module_paths;  // module_names as C++ strings (tensor names)
  std::unordered_map<const c10::TensorImpl*, Stored> stored;
  std::vector<Pending> pending;
  int64_t pending_bytes = 0;
  int64_t hand_bytes = 16 << 20;  // past this many pending bytes Python takes them at once
  py::object hand_over;  // called (GIL held) to take the pending tensors
  // module attribution by ModuleCall wrappers (hooks.observer.ObserverMode.wrap_modules), when installed
  bool active = true;  // the recorder records in this step (Recorder.active): module outputs are recorded
  bool modules_on = true;  // not paused: the wrappers push, pop and record (else they only call through)
  bool wrapped = false;
  py::object mod_stack;  // Recorder.stack, the module paths entered (the Python list itself)
  py::object mod_index;  // module path -> index into module_names (a dict)
  py::object mod_post;  // ModuleHooks._post: the forward hook's Python path, for what is recorded there
  PyTypeObject* tensor_type = nullptr;  // torch.Tensor: only exactly this type is recorded here
  int mod_root = -1;  // the index of the root's path "", used outside every module
  // CUDA (OPBAND_CUDA builds): the device whose outputs are summarised here (-1: none), the rows launched
  // since the last drain (float32, kRow each, in chunks of kChunkRows) and the sample indices there
  int cuda_device = -1;
#ifdef OPBAND_CUDA
  std::vector<DeviceChunk> device_chunks;
#endif
  int64_t device_rows = 0;
  // by (numel, stream id): made on the stream whose launches read it, so never read before it is written
  std::map<std::pair<int64_t, int64_t>, at::Tensor> device_sample_index;
  // drains inside the forward while device rows are pending (or always, `defer_all`: tests run the
  // deferred path on CPU rows) keep their records here, in order: reading the rows would sync the host
  std::vector<Held> held;
  bool defer_all = false;
  std::vector<std::string> errors;  // rows that could not be made (a failed kernel launch), for diagnostics
};

State* state = nullptr;

void Held::trade() {
  calls.swap(state->calls);
  outs.swap(state->outs);
  ints.swap(state->ints);
}
// Guards the records and rows against a drain from another thread (global module hooks fire on any
// thread). The GIL is never taken while it is held: a thread holding the GIL may be waiting for it.
std::mutex records_lock;
thread_local int leaf_depth = 0;   // > 0 inside a recorded call: its inner calls are the kernel's
struct Frame {
  OpInfo* leaf;  // the op of a call the dispatch mode would see, else nullptr
  bool under_mode;  // it ran under a tracer's dispatch mode: counted, not recorded
  // a leaf not under a mode turned this file's callback off until it ends (on_enter)
  bool muted() const { return leaf != nullptr && !under_mode; }
};
thread_local std::vector<Frame> frames;  // one per open call
thread_local bool inside = false;  // this file runs torch ops itself (sample indices)
// The open recorded call's tensor inputs, read at its start (the only time they are readable): per input
// its dtype code, its dim (-1: nested, no shape), then its sizes; no reference to the tensors is held.
thread_local std::vector<int64_t> call_inputs;
thread_local int64_t call_n_in = 0;
thread_local bool call_nested = false;

// Runs ATen ops of this file's own: neither the observer nor a dispatch mode (a nested capture's) sees them.
template <typename F>
auto quietly(F&& f) {
  struct Inside {  // restored also when `f` throws
    bool was = inside;
    Inside() { inside = true; }
    ~Inside() { inside = was; }
  } scope;
  c10::impl::ExcludeDispatchKeyGuard no_modes(
      c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
  return f();
}

int kernel_slot(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return 0;
    case at::kDouble: return 1;
    case at::kBFloat16: return 2;
    case at::kHalf: return 3;
    default: return -1;
  }
}

bool decomposed_before_python(const c10::OperatorHandle& op) {
  // OperatorEntry::computeDispatchTableEntry for AutogradCPU: a direct AutogradCPU kernel wins; then
  // the CompositeImplicitAutograd kernel, unless there is a CPU or CompositeExplicitAutograd kernel
  // (before a kernel registered to the Autograd alias)
  using K = c10::DispatchKey;
  if (!op.hasKernelForDispatchKey(K::CompositeImplicitAutograd) || op.hasKernelForDispatchKey(K::AutogradCPU)) return false;
  return !(op.hasKernelForDispatchKey(K::CPU) || op.hasKernelForDispatchKey(K::CompositeExplicitAutograd) ||
           op.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional));
}

int name_id(const std::string& name);

OpInfo classify(const at::RecordFunction& fn) {
  OpInfo info;
  auto schema = fn.operator_schema();
  if (!schema) return info;
  info.observed = true;
  const auto& op_name = schema->operator_name();
  auto handle = c10::Dispatcher::singleton().findOp(op_name);
  // autograd kernels written by hand that never call below autograd (VariableTypeManual.cpp): the
  // dispatch mode does not see these calls when autograd runs first
  static const std::unordered_set<std::string> autograd_only = {
      "aten::detach_", "aten::requires_grad_", "aten::retain_grad", "aten::retains_grad", "aten::_backward",
      "aten::set_data", "aten::data", "aten::is_leaf", "aten::output_nr", "aten::_version"};
  info.composite = (handle && decomposed_before_python(*handle)) || autograd_only.count(op_name.name) > 0;
  std::string name = op_name.name;  // "aten::mm" -> "aten.mm", as str(OpOverload.overloadpacket)
  auto sep = name.find("::");
  if (sep != std::string::npos) name.replace(sep, 2, ".");
  info.name = name_id(name);
  // OpOverload.is_view (MathBitsFallback's rule): aliased arguments that are all read-only
  int is_write = -1;
  for (const auto& a : schema->arguments()) {
    const auto* alias = a.alias_info();
    if (alias == nullptr) continue;
    is_write = (is_write == 1 || alias->isWrite()) ? 1 : 0;
  }
  bool is_view = is_write == 0;
  info.skip = state->skip_no_number && (state->no_number.count(name) > 0 || is_view);
  info.mutates = schema->is_mutable();
  return info;
}

OpInfo& info_of(const at::RecordFunction& fn) {
  const void* key = fn.overload_name();  // each schema owns its overload-name string: one address per op
  auto it = state->ops.find(key);
  if (it == state->ops.end()) it = state->ops.emplace(key, classify(fn)).first;
  return it->second;
}

const at::Tensor& sample_index(int64_t n) {
  auto it = state->sample_index.find(n);
  if (it != state->sample_index.end()) return it->second;
  if (state->sample_index.size() > 4096) state->sample_index.clear();
  // the same indices as hooks.tensors._sample_index (torch.linspace in the default dtype, clamped to n - 1)
  at::Tensor idx = quietly([n] {
    return at::linspace(0, static_cast<double>(n - 1), std::min<int64_t>(kSample, n)).round().to(at::kLong).clamp_max(n - 1);
  });
  return state->sample_index.emplace(n, std::move(idx)).first->second;
}

// The CUDA statistics kernel's code for a dtype (stats_cuda.h), or -1: hooks.triton_stats.DTYPES.
int device_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return opband_cuda::kF32;
    case at::kHalf: return opband_cuda::kF16;
    case at::kBFloat16: return opband_cuda::kBF16;
    case at::kLong: return opband_cuda::kI64;
    case at::kInt: return opband_cuda::kI32;
    case at::kShort: return opband_cuda::kI16;
    case at::kChar: return opband_cuda::kI8;
    case at::kByte: return opband_cuda::kU8;
    case at::kBool: return opband_cuda::kBool;
    default: return -1;
  }
}

#ifdef OPBAND_CUDA
// The row of the CUDA tensor `t` (a dtype device_dtype takes) written to `row` on the device, launched on
// the current stream of its device: hooks.triton_stats.stats_row's input handling (flat, contiguous when its
// flat view is strided), `idx` its sample's flat indices there. No host sync.
void launch_row(const at::Tensor& t, const at::Tensor& idx, int64_t size, float* row, const c10::Stream& stream) {
  const c10::DeviceGuard guard(t.device());
  at::Tensor x = t.reshape(-1);
  if (x.numel() > 1 && x.stride(0) != 1) x = x.contiguous();
  const int64_t n = x.numel();
  const opband_cuda::Plan plan = opband_cuda::plan(n);
  at::Tensor part;
  if (plan.programs > 1) part = at::empty({plan.programs * opband_cuda::kParts}, x.options().dtype(at::kDouble));
  const char* err = opband_cuda::stats_row(x.const_data_ptr(), device_dtype(x.scalar_type()), n, idx.const_data_ptr<int64_t>(),
                                           idx.numel(), row, static_cast<int>(size),
                                           part.defined() ? part.mutable_data_ptr<double>() : nullptr, plan,
                                           stream.native_handle());
  TORCH_CHECK(err == nullptr, "opband: the CUDA statistics kernel failed to launch: ", err);
}

c10::Stream current_stream(const at::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
}

// hooks.tensors.device_stats's row of a CUDA tensor through this file's kernel (the dispatch mode's path):
// the observer's records and the dispatch mode's hold the same bits.
at::Tensor cuda_stats_row(const at::Tensor& values, const at::Tensor& sample_index, int64_t sample_size) {
  TORCH_CHECK(values.is_cuda() && device_dtype(values.scalar_type()) >= 0 && values.numel() > 0,
              "cuda_stats_row takes a non-empty CUDA tensor of float32, float16, bfloat16, an integer type or bool");
  TORCH_CHECK(sample_index.is_cuda() && sample_index.scalar_type() == at::kLong && sample_index.is_contiguous() &&
                  sample_index.numel() <= sample_size && sample_index.get_device() == values.get_device(),
              "cuda_stats_row: the sample index must be a contiguous int64 tensor on the values' device, at most sample_size long");
  at::Tensor row = at::empty({kStatFields + sample_size}, values.options().dtype(at::kFloat));
  quietly([&] {
    launch_row(values, sample_index, sample_size, row.mutable_data_ptr<float>(), current_stream(values.device()));
    return 0;
  });
  return row;
}

constexpr int64_t kChunkRows = 4096;

// The same indices as hooks.tensors._sample_index(n, device), made on the device (no host sync) on
// `stream`, the one whose launches read them (clearing the cache frees them in that stream's order).
const at::Tensor& device_sample_index(int64_t n, const c10::Stream& stream) {
  const std::pair<int64_t, int64_t> key(n, static_cast<int64_t>(stream.id()));
  auto it = state->device_sample_index.find(key);
  if (it != state->device_sample_index.end()) return it->second;
  if (state->device_sample_index.size() > 4096) state->device_sample_index.clear();
  at::Tensor idx = at::linspace(0, static_cast<double>(n - 1), std::min<int64_t>(kSample, n),
                                at::TensorOptions().device(stream.device()))
                       .round()
                       .to(at::kLong)
                       .clamp_max(n - 1);
  return state->device_sample_index.emplace(key, std::move(idx)).first->second;
}

// A CUDA output's row, launched on the current stream into the next slot of the device rows (read back
// at the drain). A chunk written from a stream other than its own is recorded on that stream, so that
// freeing it (stop() without a drain) waits for those launches. A launch that fails leaves no row and a
// diagnostic, never a row of zeros.
void device_row(const at::Tensor& t, Out& out) {
  try {
    quietly([&] {
      const c10::Stream stream = current_stream(t.device());
      const int64_t slot = state->device_rows;
      const size_t chunk = static_cast<size_t>(slot / kChunkRows);
      if (chunk == state->device_chunks.size()) {
        DeviceChunk& made = state->device_chunks.emplace_back(
            DeviceChunk{at::empty({kChunkRows, kRow}, t.options().dtype(at::kFloat)), stream});
        made.made.record(stream);
      }
      DeviceChunk& c = state->device_chunks[chunk];
      if (c.stream != stream && std::find(c.joined.begin(), c.joined.end(), stream.id()) == c.joined.end()) {
        c.made.block(stream);
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->recordDataPtrOnStream(c.rows.storage().data_ptr(), stream);
        c.joined.push_back(stream.id());
      }
      float* row = c.rows.mutable_data_ptr<float>() + (slot % kChunkRows) * kRow;
      launch_row(t, device_sample_index(t.numel(), stream), kSample, row, stream);
      out.device_row = slot;
      ++state->device_rows;
      return 0;
    });
  } catch (const std::exception& e) {
    out.has_row = false;
    if (state->errors.size() < 16) state->errors.emplace_back(e.what());
  }
}

// The device rows launched since the last drain, copied to the host (the drain's one wait for the device)
// into their outputs' rows (records_lock held).
void fetch_device_rows() {
  if (state->device_rows == 0) return;
  quietly([] {
    c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(static_cast<c10::DeviceIndex>(state->cuda_device));
    std::vector<at::Tensor> host;
    for (int64_t first = 0, c = 0; first < state->device_rows; first += kChunkRows, ++c) {
      const int64_t rows = std::min(kChunkRows, state->device_rows - first);
      host.push_back(state->device_chunks[static_cast<size_t>(c)].rows.narrow(0, 0, rows).to(at::kCPU).to(at::kDouble));
    }
    auto fill = [&](std::vector<Out>& outs) {
      for (Out& o : outs) {
        if (o.device_row < 0) continue;
        const double* r = host[static_cast<size_t>(o.device_row / kChunkRows)].const_data_ptr<double>() + (o.device_row % kChunkRows) * kRow;
        std::copy(r, r + kRow, o.row.begin());
        o.device_row = -1;
      }
    };
    for (Held& h : state->held) fill(h.outs);
    fill(state->outs);
    state->device_rows = 0;
    return 0;
  });
}
#endif

bool integer_like(at::ScalarType t) {  // summarised as float64 values, as hooks.tensors.host_stats does
  switch (t) {
    case at::kLong: case at::kInt: case at::kShort: case at::kChar: case at::kByte:
    case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
      return true;
    default:
      return false;
  }
}

// Whether the observer summarises this output itself; else the whole call goes to Python.
bool native(const at::Tensor& t) {
  if (!t.defined()) return true;  // an undefined output is None in Python: not recorded
  if (t.layout() != at::kStrided || t.is_nested() || t.unsafeGetTensorImpl()->is_python_dispatch()) return false;
  if (t.key_set().has(c10::DispatchKey::FuncTorchGradWrapper) || t.key_set().has(c10::DispatchKey::FuncTorchBatched))
    return false;
  if (t.is_cuda()) return state->cuda_device >= 0 && t.get_device() == state->cuda_device && device_dtype(t.scalar_type()) >= 0;
  if (!t.is_cpu()) return false;
  const at::ScalarType type = t.scalar_type();
  if (type == at::kBool) return true;
  if (kernel_slot(type) < 0 && !integer_like(type)) return false;  // quantized, complex, …: the recorder's payloads
  return !(t.numel() >= state->parallel_min && at::get_num_threads() > 1);  // the Python path's parallel row
}


template <typename Values, typename F>
bool each_tensor(const Values& values, F&& f) {
  for (const auto& v : values) {
    if (v.isTensor()) {
      if (!f(v.toTensor())) return false;
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec())
        if (!f(t)) return false;
    } else if (v.isList()) {
      for (const auto& e : v.toListRef()) {
        if (e.isTensor() && !f(e.toTensor())) return false;
      }
    }
  }
  return true;
}

// hooks.tensors._dense_offsets: for a non-contiguous tensor whose elements fill numel consecutive
// slots from its data pointer (a permutation of a contiguous one), the storage offsets of the
// sample elements, read in storage order; undefined when it has gaps or overlaps.
at::Tensor dense_offsets(const at::Tensor& x) {
  const auto shape = x.sizes();
  const auto stride = x.strides();
  std::vector<std::pair<int64_t, int64_t>> dims;
  for (size_t d = 0; d < shape.size(); ++d)
    if (shape[d] != 1) dims.emplace_back(stride[d], shape[d]);
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [st, sz] : dims) {
    if (st != expected) return at::Tensor();
    expected *= sz;
  }
  const at::Tensor& flat = sample_index(x.numel());
  at::Tensor where = quietly([&] { return at::empty({flat.numel()}, at::kLong); });
  int64_t* out = where.data_ptr<int64_t>();
  const int64_t* at = flat.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < flat.numel(); ++j) {
    int64_t rest = at[j], off = 0;
    for (size_t d = shape.size(); d-- > 0;) {
      off += (rest % shape[d]) * stride[d];
      rest /= shape[d];
    }
    out[j] = off;
  }
  return where;
}

// hooks.tensors._bool_stats: a boolean tensor's row from its count of true values.
void bool_row(const at::Tensor& t, Out& out) {
  const int64_t n = t.numel();
  const at::Tensor& idx = sample_index(n);
  auto [nz, sample] = quietly([&] {
    return std::make_pair(at::count_nonzero(t).item<int64_t>(), t.reshape(-1).index_select(0, idx).to(at::kDouble));
  });
  const double mean = static_cast<double>(nz) / static_cast<double>(n);
  auto& r = out.row;
  r.fill(0.0);
  r[0] = static_cast<double>(n);
  r[1] = nz < n ? 0.0 : 1.0;
  r[2] = nz ? 1.0 : 0.0;
  r[3] = mean;
  r[4] = std::sqrt(std::max(mean - mean * mean, 0.0));
  r[5] = std::sqrt(static_cast<double>(nz));
  r[6] = nz ? 1.0 : 0.0;
  r[9] = static_cast<double>(n - nz);
  const double* s = sample.const_data_ptr<double>();
  for (int64_t j = 0; j < sample.numel(); ++j) r[kStatFields + j] = s[j];
}

// An output's shape, kept in State::ints (records_lock held).
void set_shape(Out& out, const at::Tensor& t) {
  out.shape_at = static_cast<int64_t>(state->ints.size());
  out.ndim = t.dim();
  state->ints.insert(state->ints.end(), t.sizes().begin(), t.sizes().end());
}

// A call's input tensors' dtypes and shapes, kept in State::ints (records_lock held).
void set_inputs(Call& call, const std::vector<at::Tensor>& ins) {
  auto& ints = state->ints;
  call.in_at = static_cast<int64_t>(ints.size());
  call.n_in = static_cast<int64_t>(ins.size());
  for (const at::Tensor& t : ins) {
    ints.push_back(static_cast<int64_t>(t.scalar_type()));
    ints.push_back(t.dim());
    ints.insert(ints.end(), t.sizes().begin(), t.sizes().end());
  }
}

// An output's row, computed; returns the entry registered for its memory (contiguous float tensors),
// else nullptr.
Seen* summarise(const at::Tensor& t, Out& out) {
  const int64_t n = t.numel();
  set_shape(out, t);
  out.dtype = static_cast<int8_t>(t.scalar_type());
  out.layout = 0;
  if (!t.is_contiguous()) {  // hooks.opcall.layout_of
    state->ints.insert(state->ints.end(), t.strides().begin(), t.strides().end());
    out.layout = t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)     ? 1
                 : t.dim() == 5 && t.is_contiguous(at::MemoryFormat::ChannelsLast3d) ? 2
                                                                                      : 3;
  }
  out.has_row = n > 0;
  if (n == 0) return nullptr;
#ifdef OPBAND_CUDA
  if (t.is_cuda()) {  // its row stays on the device until the drain; not registered for reuse (seen_entry reads CPU memory)
    device_row(t, out);
    return nullptr;
  }
#endif
  if (t.scalar_type() == at::kBool) {
    bool_row(t, out);
    return nullptr;
  }
  int slot = kernel_slot(t.scalar_type());
  at::Tensor x = t, where;
  if (slot < 0) {  // integers and FP8: their float64 values
    x = quietly([&] { return t.reshape(-1).to(at::kDouble); });
    slot = 1;
  } else if (!t.is_contiguous()) {
    where = dense_offsets(t);
    if (!where.defined()) x = quietly([&] { return t.contiguous(); });
  }
  const at::Tensor& idx = where.defined() ? where : sample_index(n);
  state->row_fn[slot](reinterpret_cast<int64_t>(x.const_data_ptr()), n, reinterpret_cast<int64_t>(idx.const_data_ptr()),
                      idx.numel(), state->cancel[slot], out.row.data(), kRow);
  if (t.has_storage() && t.is_contiguous() && kernel_slot(t.scalar_type()) >= 0) {
    if (state->seen.size() > SeenTable::kMaxSeen) state->seen.clear();
    const c10::Storage& storage = t.storage();
    return state->seen.insert_or_assign(Where{storage.unsafeGetStorageImpl(), t.storage_offset(), n, out.dtype},
                                        Seen{c10::weak_intrusive_ptr<c10::StorageImpl>(storage.getWeakStorageImpl()), out.row});
  }
  return nullptr;
}

double element(const at::Tensor& t, int64_t i) {
  switch (t.scalar_type()) {
    case at::kFloat: return t.const_data_ptr<float>()[i];
    case at::kDouble: return t.const_data_ptr<double>()[i];
    case at::kBFloat16: return static_cast<float>(t.const_data_ptr<c10::BFloat16>()[i]);
    default: return static_cast<float>(t.const_data_ptr<c10::Half>()[i]);
  }
}

// The entry of an output summarised since the last in-place write that holds the same elements in
// the same memory as `t` (any shape), or nullptr (records_lock held). Its sampled elements are read
// again, as StatsBatch._unchanged does: a guard against writes no dispatcher call made.
Seen* seen_entry(const at::Tensor& t) {
  if (state == nullptr || !t.defined() || !t.is_cpu() || !t.has_storage() || !t.is_contiguous() || t.numel() == 0 ||
      kernel_slot(t.scalar_type()) < 0)
    return nullptr;
  const c10::Storage& storage = t.storage();
  const int64_t n = t.numel();
  Seen* seen = state->seen.find(Where{storage.unsafeGetStorageImpl(), t.storage_offset(), n, static_cast<int8_t>(t.scalar_type())});
  if (seen == nullptr) return nullptr;
  auto held = seen->storage.lock();
  if (!held || held.get() != storage.unsafeGetStorageImpl()) return nullptr;
  const auto& row = seen->row;
  const at::Tensor& idx = sample_index(n);
  const int64_t* at = idx.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j) {
    const double now = element(t, at[j]), then = row[kStatFields + j];
    if (!(now == then || (now != now && then != then))) return nullptr;
  }
  return seen;
}

// An output whose row is `seen`'s (the same memory, unchanged): its own shape and dtype.
void reuse_row(const at::Tensor& t, const Seen& seen, Out& out) {
  set_shape(out, t);
  out.dtype = static_cast<int8_t>(t.scalar_type());
  out.layout = 0;  // seen rows are of contiguous tensors
  out.has_row = true;
  out.row = seen.row;
}

// seen_entry for Python (StatsBatch.lookup): a module output that aliases an op's output, any shape.
// Its sampled elements are read again, as StatsBatch._unchanged does: a guard against writes no
// dispatcher call made.
py::object row_of(const at::Tensor& t) {
  std::lock_guard<std::mutex> lock(records_lock);
  const Seen* seen = seen_entry(t);
  if (seen == nullptr) return py::none();
  py::list out(kRow);
  for (int i = 0; i < kRow; ++i) out[i] = py::float_(seen->row[i]);
  return out;
}

// Full mode: the name of the tensor stored from `t` itself at its current version (Recorder.stored),
// or nullptr (records_lock held).
const std::string* stored_as(const at::Tensor& t) {
  if (t.is_inference()) return nullptr;  // no version counter: never matched
  auto it = state->stored.find(t.unsafeGetTensorImpl());
  if (it == state->stored.end()) return nullptr;
  auto held = it->second.impl.lock();
  if (held.get() != t.unsafeGetTensorImpl() || it->second.version != static_cast<int64_t>(t._version())) return nullptr;
  return &it->second.name;
}

// Full mode, Recorder._store's rules for an output recorded here (records_lock held): the name of the
// tensor its record gives. The same tensor at the same version, or (`aliased`) a tensor stored from
// the same memory whose row this output reuses (`memory`'s), is not stored again; anything else is
// queued for Python under `name` (written in place: `mutated`, never matched).
std::string store(const at::Tensor& t, const std::string& name, bool mutated, Seen* memory, bool aliased) {
  if (!mutated) {
    if (const std::string* prior = stored_as(t)) return *prior;
    if (aliased && !memory->tensor.empty()) return memory->tensor;
  }
  at::Tensor values = t.is_contiguous() ? t : quietly([&] { return t.contiguous(); });
  state->pending_bytes += values.nbytes();
  state->pending.push_back({name, static_cast<int8_t>(t.scalar_type()), std::vector<int64_t>(t.sizes().begin(), t.sizes().end()),
                            std::move(values)});
  if (mutated) return name;
  if (!t.is_inference()) {
    if (state->stored.size() > (1 << 16)) state->stored.clear();
    state->stored.insert_or_assign(t.unsafeGetTensorImpl(),
                                   Stored{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(t.getIntrusivePtr()),
                                          static_cast<int64_t>(t._version()), name});
  }
  if (memory != nullptr) memory->tensor = name;
  return name;
}

// One recorded output: its row (the earlier row of the same unchanged memory, as StatsBatch.add reuses
// it, unless the op wrote in place; else summarised) and in full mode the name of its stored tensor
// (`name()` builds the record's own).
template <typename Name>
void record_output(const at::Tensor& t, Out& out, bool mutated, Name&& name) {
  Seen* alias = mutated ? nullptr : seen_entry(t);
  Seen* memory = alias;
  if (alias != nullptr) reuse_row(t, *alias, out);
  else memory = summarise(t, out);
  if (state->full) out.tensor = store(t, name(), mutated, memory, alias != nullptr);
}

// For the recorder's Python path (Recorder._store, full mode): the name of a tensor stored here that
// an output it records is (the same tensor at the same version) or, with `share`, aliases (the same
// memory, unchanged, whose row it reuses), or None: it stores the output itself.
py::object stored_name(const at::Tensor& t, bool share) {
  std::lock_guard<std::mutex> lock(records_lock);
  if (state == nullptr || !state->full || !t.defined()) return py::none();
  if (const std::string* prior = stored_as(t)) return py::str(*prior);
  if (share) {
    const Seen* seen = seen_entry(t);
    if (seen != nullptr && !seen->tensor.empty()) return py::str(seen->tensor);
  }
  return py::none();
}

// A record's tensor name: its key, plus ":N" for output N > 0 (Record.id).
// hooks.recorder.step_suffix: "@N" after the key of a record of step N > 0 when steps number their calls afresh
template <class Text>
void step_suffix(Text& out, int64_t step) {
  if (state->per_step && step > 0) {
    char buf[24];
    out += '@';
    out.append(buf, std::to_chars(buf, buf + sizeof buf, step).ptr);
  }
}

std::string record_id(int module, const std::string& op, int64_t ordinal, int output) {
  std::string id = module >= 0 ? state->module_paths[static_cast<size_t>(module)] : std::string();
  id += '/';
  id += op;
  id += '#';
  id += std::to_string(ordinal);
  step_suffix(id, state->step);
  if (output > 0) {
    id += ':';
    id += std::to_string(output);
  }
  return id;
}

int name_id(const std::string& name) {
  auto it = state->name_index.find(name);
  if (it == state->name_index.end()) {
    it = state->name_index.emplace(name, static_cast<int>(state->names.size())).first;
    state->names.push_back(name);
  }
  return it->second;
}

py::list as_list(const std::vector<py::object>& items) {
  py::list l(items.size());
  for (size_t i = 0; i < items.size(); ++i) l[i] = items[i];
  return l;
}

// The whole call to the Python recorder (GIL held by call_python), under the key made here.
void escape(const at::RecordFunction& fn, const OpInfo& info, int64_t ordinal) {
  std::vector<py::object> outs;
  for (const auto& v : fn.outputs()) outs.push_back(torch::jit::toPyObject(v));
  py::list shapes(call_n_in), dtypes(call_n_in);  // the inputs' signature (Recorder.record's)
  for (int64_t i = 0, at = 0; i < call_n_in; ++i) {
    dtypes[i] = py::int_(call_inputs[at]);
    const int64_t dim = call_inputs[at + 1];
    if (dim < 0) {
      shapes[i] = py::none();
      at += 2;
      continue;
    }
    py::list shape(dim);
    for (int64_t d = 0; d < dim; ++d) shape[d] = py::int_(call_inputs[at + 2 + d]);
    shapes[i] = std::move(shape);
    at += 2 + dim;
  }
  py::object out = outs.size() == 1 ? outs[0] : py::object(py::tuple(as_list(outs)));
  state->escape(state->module, state->names[info.name], ordinal, out, shapes, dtypes, info.mutates);
}

// Whether a tracer's infrastructure mode (fake tensors, proxies, functionalization: torch.compile,
// make_fx, export) runs this call: its tensors are not the model's numbers. User-level dispatch modes
// (a FLOP counter, another capture's) run the real op, which is recorded.
bool under_tracing() {
  if (!c10::impl::dispatch_mode_enabled()) return false;
  using M = c10::impl::TorchDispatchModeKey;
  using TLS = c10::impl::TorchDispatchModeTLS;
  return TLS::get_mode(M::FAKE).has_value() || TLS::get_mode(M::PROXY).has_value() ||
         TLS::get_mode(M::FUNCTIONAL).has_value();
}

// Whether the call's dispatch starts at an autograd key, whose CompositeImplicitAutograd entry
// decomposes the op before the Python key: not under inference mode (autograd keys excluded), nor
// for inference tensors or a factory call (no input carries an autograd key). Then the dispatch
// mode sees the composite op itself, and so does the observer.
bool autograd_runs_first(const at::RecordFunction& fn) {
  c10::DispatchKeySet keys;  // the dispatcher's set: the inputs' keys, plus TLS included, minus TLS excluded
  each_tensor(fn.inputs(), [&](const at::Tensor& t) {
    if (t.defined()) keys = keys | t.key_set();
    return true;
  });
  const auto& tls = c10::impl::tls_local_dispatch_key_set();
  return ((keys | tls.included_) - tls.excluded_).has_any(c10::autograd_dispatch_keyset);
}

// Runs a Python callable with the GIL; its torch ops are not the model's (`inside`), and a Python
// error never reaches the model's forward (the recorder turns its own failures into diagnostics).
template <typename F>
void call_python(F&& f) {
  inside = true;
  {
    py::gil_scoped_acquire gil;
    try {
      f();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable(__func__);
    }
  }
  inside = false;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  // our own ops, inside a recorded call's kernel, or where the Python key is excluded (tensor
  // construction from data): calls a dispatch mode does not see
  if (inside || state == nullptr || leaf_depth > 0 ||
      c10::impl::tls_local_dispatch_key_set().excluded_.has(c10::DispatchKey::Python)) {
    frames.push_back({nullptr, false});
    return nullptr;
  }
  OpInfo& info = info_of(fn);
  if (!info.observed || (info.composite && autograd_runs_first(fn))) {  // the dispatch mode would not see it
    frames.push_back({nullptr, false});
    return nullptr;
  }
  if (under_tracing()) {  // fake tensors, not the model's run; the mode's inner calls are not new ops
    frames.push_back({&info, true});
    ++leaf_depth;
    return nullptr;
  }
  if (info.mutates) {
    ++state->epoch;  // earlier statistics no longer describe memory this op writes
    {
      std::lock_guard<std::mutex> lock(records_lock);
      if (!state->seen.empty()) state->seen.clear();
    }
    // background readers of the model's memory (the weight walk before the first write; in full mode
    // the bundle writer, which reads the tensors queued so far) finish before it writes
    if (state->settle_pending || state->full) {
      state->settle_pending = false;
      call_python([] { state->settle(); });
    }
  }
  // The kernel's own calls are not recorded (leaf_depth): with this file's callback off until the call
  // ends they take the dispatcher's fast path, not boxed for it; other callbacks (a profiler) still run,
  // and this call's end callback runs (RecordFunction keeps the callbacks it started with).
  frames.push_back({&info, false});
  at::disableCallback(state->handle);
  ++leaf_depth;
  call_inputs.clear();  // inputs are readable only here, at the call's start
  call_n_in = 0;
  call_nested = false;
  if (state->on && !info.skip) {
    each_tensor(fn.inputs(), [](const at::Tensor& t) {  // a wrapped number is a Python scalar to the mode
      if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return true;
      ++call_n_in;
      call_inputs.push_back(static_cast<int64_t>(t.scalar_type()));
      if (t.is_nested()) {
        call_nested = true;
        call_inputs.push_back(-1);
        return true;
      }
      call_inputs.push_back(t.dim());
      call_inputs.insert(call_inputs.end(), t.sizes().begin(), t.sizes().end());
      return true;
    });
  }
  return nullptr;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext*) {
  if (frames.empty()) return;
  const Frame frame = frames.back();
  frames.pop_back();
  if (frame.muted() && state != nullptr) at::reenableCallback(state->handle);
  if (frame.leaf == nullptr) return;
  --leaf_depth;
  if (state == nullptr || !state->on) return;
  OpInfo& info = *frame.leaf;
  if (frame.under_mode) {
    ++info.under_mode;
    return;
  }
  if (info.skip) {
    ++info.skipped;
    return;
  }
  if (torch::autograd::get_current_graph_task_id() != -1) {
    ++info.backward;
    return;
  }
  const uint64_t okey = (static_cast<uint64_t>(static_cast<uint32_t>(state->module)) << 32) | static_cast<uint32_t>(info.name);
  const int64_t ordinal = state->ordinals.next(okey);
  ++state->ops_seen;
  const auto& outputs = fn.outputs();
  if (call_nested || !each_tensor(outputs, native)) {
    call_python([&] { escape(fn, info, ordinal); });
    call_inputs.clear();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(records_lock);
    Call call{state->module, info.name, 0, ordinal, state->step, static_cast<int64_t>(state->ints.size()), call_n_in};
    state->ints.insert(state->ints.end(), call_inputs.begin(), call_inputs.end());  // set_inputs' layout
    call_inputs.clear();
    const int64_t call_index = static_cast<int64_t>(state->calls.size());
    int out_i = 0;
    each_tensor(outputs, [&](const at::Tensor& t) {
      if (!t.defined()) return true;
      Out& out = state->outs.emplace_back();
      out.call = call_index;
      out.output = out_i++;
      record_output(t, out, info.mutates, [&] {
        return record_id(call.module, state->names[static_cast<size_t>(info.name)], ordinal, out.output);
      });
      return true;
    });
    state->calls.push_back(std::move(call));
    if (state->pending_bytes < state->hand_bytes) return;
  }
  call_python([] { state->hand_over(); });  // bounded memory: the writer takes what is queued
}

// A module's output, recorded as ModuleHooks would ("path/forward#N", kind "module"), in order
// with the ops; a row summarised since the last in-place write is reused. False (nothing recorded)
// when an output is not one this file summarises: the recorder's Python path records it.
bool record_module(int module, const std::vector<at::Tensor>& outs, const std::vector<at::Tensor>& ins, int innermost) {
  if (state == nullptr) return false;
  state->module = innermost;
  for (const at::Tensor& t : outs)
    if (!t.defined() || !native(t)) return false;
  for (const at::Tensor& t : ins)
    if (t.defined() && t.is_nested()) return false;
  std::lock_guard<std::mutex> lock(records_lock);
  const int name = name_id("forward");
  const uint64_t okey = (static_cast<uint64_t>(static_cast<uint32_t>(module)) << 32) | static_cast<uint32_t>(name);
  const int64_t ordinal = state->ordinals.next(okey);
  ++state->ops_seen;
  Call call{module, name, 1, ordinal, state->step, 0, 0};
  set_inputs(call, ins);
  const int64_t call_index = static_cast<int64_t>(state->calls.size());
  int out_i = 0;
  for (const at::Tensor& t : outs) {
    Out& out = state->outs.emplace_back();
    out.call = call_index;
    out.output = out_i++;
    record_output(t, out, false, [&] { return record_id(module, "forward", ordinal, out.output); });
  }
  state->calls.push_back(std::move(call));
  return true;  // the caller (Python) takes the pending tensors next
}

// -- module attribution without torch's hooked call path -----------------------------------------
// A ModuleCall is set as a module's instance `forward` (hooks.observer.ObserverMode.wrap_modules): it
// does what ModuleHooks' global forward pre- and post-hook do (push the module's path on
// Recorder.stack, pop it back, record the output), so nn.Module._call_impl keeps its fast path and no
// Python runs per module. Outputs and positional arguments that are not plain tensors (or tuples and
// lists of tensors and scalars) go to ModuleHooks._post as before. A forward that raises leaves the
// stack as global hooks would (no forward hook runs).

struct ModuleCall {
  PyObject_HEAD
  PyObject* forward;  // the forward this replaces (a bound method)
  PyObject* module;
  PyObject* name;  // its path, the str object Recorder.stack holds for it
  int index;
};

bool atom(PyObject* o) {  // a leaf hooks.tensors.fast_leaves skips (a subset of its _ATOMS)
  return o == Py_None || PyBool_Check(o) || PyLong_CheckExact(o) || PyFloat_CheckExact(o) || PyUnicode_CheckExact(o);
}

// The tensors of `o` as fast_leaves finds them, when they are all exactly torch.Tensor and `o` is one
// or a tuple or list of them and atoms; false otherwise (the Python path walks it).
bool plain_leaves(PyObject* o, std::vector<at::Tensor>& out) {
  if (Py_TYPE(o) == state->tensor_type) {
    out.push_back(THPVariable_Unpack(o));
    return true;
  }
  if (!PyTuple_CheckExact(o) && !PyList_CheckExact(o)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  PyObject** items = PySequence_Fast_ITEMS(o);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (Py_TYPE(items[i]) == state->tensor_type) out.push_back(THPVariable_Unpack(items[i]));
    else if (!atom(items[i])) return false;
  }
  return true;
}

// ModuleHooks._post's pop: back to this module, even if an inner forward raised earlier.
bool pop_to(PyObject* name) {
  PyObject* stack = state->mod_stack.ptr();
  while (PyList_GET_SIZE(stack) > 0) {
    const Py_ssize_t n = PyList_GET_SIZE(stack);
    PyObject* top = PyList_GET_ITEM(stack, n - 1);
    Py_INCREF(top);
    if (PyList_SetSlice(stack, n - 1, n, nullptr) < 0) {
      Py_DECREF(top);
      return false;
    }
    const int same = top == name ? 1 : PyObject_RichCompareBool(top, name, Py_EQ);
    Py_DECREF(top);
    if (same < 0) return false;
    if (same) break;
  }
  return true;
}

// ObserverMode.innermost: the index of the path on top of the stack, the root's outside every module.
int innermost_index() {
  PyObject* stack = state->mod_stack.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(stack);
  if (n == 0) return state->mod_root;
  PyObject* v = PyDict_GetItemWithError(state->mod_index.ptr(), PyList_GET_ITEM(stack, n - 1));
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  return static_cast<int>(PyLong_AsLong(v));
}

// The forward hook's work; false with a Python error set.
bool module_returned(ModuleCall* self, PyObject* args, PyObject* output) {
  std::vector<at::Tensor> outs, ins;
  if (plain_leaves(output, outs) && plain_leaves(args, ins)) {
    if (!pop_to(self->name)) return false;
    const int inner = innermost_index();
    if (!state->active) {  // nothing to record
      state->module = inner;
      return true;
    }
    bool recorded = false;
    try {
      recorded = record_module(self->index, outs, ins, inner);
    } catch (const std::exception&) {  // the Python path says what is wrong with this output
      recorded = false;
    }
    if (recorded) {
      if (!state->full) return true;
      try {
        state->hand_over();  // full mode: its tensors go to the writer between modules
      } catch (py::error_already_set& e) {
        e.restore();
        return false;
      }
      return true;
    }
    if (PyList_Append(state->mod_stack.ptr(), self->name) < 0) return false;  // the Python path pops it itself
  }
  PyObject* r = PyObject_CallFunctionObjArgs(state->mod_post.ptr(), self->module, args, output, nullptr);
  if (r == nullptr) return false;
  Py_DECREF(r);
  return true;
}

PyObject* module_call(PyObject* self_, PyObject* args, PyObject* kwargs) {
  auto* self = reinterpret_cast<ModuleCall*>(self_);
  if (state == nullptr || !state->wrapped || !state->modules_on) return PyObject_Call(self->forward, args, kwargs);
  if (PyList_Append(state->mod_stack.ptr(), self->name) < 0) return nullptr;
  state->module = self->index;
  PyObject* output = PyObject_Call(self->forward, args, kwargs);
  if (output == nullptr || state == nullptr || !state->wrapped) return output;
  if (!module_returned(self, args, output)) {
    Py_DECREF(output);
    return nullptr;
  }
  return output;
}

int module_call_traverse(PyObject* self_, visitproc visit, void* arg) {
  auto* self = reinterpret_cast<ModuleCall*>(self_);
  Py_VISIT(self->forward);
  Py_VISIT(self->module);
  Py_VISIT(self->name);
  return 0;
}

int module_call_clear(PyObject* self_) {
  auto* self = reinterpret_cast<ModuleCall*>(self_);
  Py_CLEAR(self->forward);
  Py_CLEAR(self->module);
  Py_CLEAR(self->name);
  return 0;
}

void module_call_dealloc(PyObject* self_) {
  PyObject_GC_UnTrack(self_);
  module_call_clear(self_);
  PyTypeObject* type = Py_TYPE(self_);
  type->tp_free(self_);
  Py_DECREF(type);
}

PyMemberDef module_call_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(ModuleCall, forward), READONLY, "the forward it calls (inspect.signature)"},
    {"__self__", T_OBJECT, offsetof(ModuleCall, module), READONLY, "the module"},
    {nullptr, 0, 0, 0, nullptr}};

PyType_Slot module_call_slots[] = {
    {Py_tp_call, reinterpret_cast<void*>(module_call)},
    {Py_tp_traverse, reinterpret_cast<void*>(module_call_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(module_call_clear)},
    {Py_tp_dealloc, reinterpret_cast<void*>(module_call_dealloc)},
    {Py_tp_members, module_call_members},
    {Py_tp_doc, const_cast<char*>("a module's forward with opband's module attribution around it")},
    {0, nullptr}};

PyType_Spec module_call_spec = {"hooks._observer.ModuleCall", sizeof(ModuleCall), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, module_call_slots};

PyTypeObject* module_call_type = nullptr;

py::object module_call_new(py::object forward, py::object module, py::str name, int index) {
  auto* self = PyObject_GC_New(ModuleCall, module_call_type);
  if (self == nullptr) throw py::error_already_set();
  self->forward = forward.release().ptr();
  self->module = module.release().ptr();
  self->name = name.release().ptr();
  self->index = index;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(self));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(self));
}

void wrap_modules(py::list stack, py::dict index, py::object post, py::object tensor_type, int root) {
  TORCH_CHECK(state != nullptr, "start the observer first");
  state->mod_stack = std::move(stack);
  state->mod_index = std::move(index);
  state->mod_post = std::move(post);
  state->tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.ptr());
  state->mod_root = root;
  state->wrapped = true;
}

void unwrap_modules() {
  if (state == nullptr) return;
  state->wrapped = false;
  state->mod_stack = py::object();
  state->mod_index = py::object();
  state->mod_post = py::object();
}

// Full mode: the tensors queued since the last call, as (name, c10::ScalarType code, shape, HeldBytes),
// for Recorder.write_stored (GIL held by the caller).
py::list take_writes() {
  std::vector<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(records_lock);
    if (state == nullptr) return py::list();
    pending.swap(state->pending);
    state->pending_bytes = 0;
  }
  py::list out(pending.size());
  for (size_t i = 0; i < pending.size(); ++i) {
    Pending& p = pending[i];
    py::tuple shape(p.shape.size());
    for (size_t d = 0; d < p.shape.size(); ++d) shape[d] = py::int_(p.shape[d]);
    out[i] = py::make_tuple(py::str(p.name), static_cast<int>(p.dtype), std::move(shape), HeldBytes{std::move(p.values)});
  }
  return out;
}

void start(py::dict opts) {
  TORCH_CHECK(state == nullptr, "an observer capture is already active in this process");
  const auto fields = opts["stat_fields"].cast<std::vector<std::string>>();
  const auto counts = opts["stat_counts"].cast<std::vector<std::string>>();
  const auto sample = opts["sample_size"].cast<int64_t>();
  TORCH_CHECK(fields.size() == kStatFields && sample == kSample, "hooks._observer was built for a statistics row of ",
              kStatFields, " fields and ", kSample, " samples, the capture format has ", fields.size(), " and ", sample,
              ": reinstall opband");
  state = new State();
  state->calls.reserve(4096);  // a decode step's records without regrowing (Out is ~300 bytes)
  state->outs.reserve(4096);
  state->ints.reserve(1 << 15);
  for (int f = 0; f < kStatFields; ++f) {
    state->stat_keys[f] = (f ? ",\"" : "{\"") + fields[f] + "\":";
    state->stat_count[f] = std::find(counts.begin(), counts.end(), fields[f]) != counts.end();
  }
  state->per_step = opts["per_step"].cast<bool>();
  state->skip_no_number = opts["skip_no_number_ops"].cast<bool>();
  for (auto name : opts["no_number_ops"].cast<py::list>()) state->no_number.insert(name.cast<std::string>());
  auto fns = opts["row_functions"].cast<std::vector<int64_t>>();
  auto cancel = opts["cancel"].cast<std::vector<double>>();
  for (int i = 0; i < 4; ++i) {
    state->row_fn[i] = reinterpret_cast<RowFn>(fns.at(i));
    state->cancel[i] = cancel.at(i);
  }
  state->parallel_min = opts["parallel_min"].cast<int64_t>();
  state->module_names = opts["module_names"].cast<std::vector<py::str>>();
  state->settle = opts["settle"];
  state->escape = opts["escape"];
  state->full = opts["full"].cast<bool>();
  state->hand_over = opts["hand_over"];
  state->hand_bytes = opts["hand_bytes"].cast<int64_t>();
  state->cuda_device = opts.contains("cuda_device") ? opts["cuda_device"].cast<int>() : -1;
  state->defer_all = opts.contains("defer_all") && opts["defer_all"].cast<bool>();
#ifndef OPBAND_CUDA
  TORCH_CHECK(state->cuda_device < 0, "hooks._observer was built without CUDA: a CUDA model takes the dispatch mode");
#endif
  TORCH_CHECK(state->cuda_device < 0 || !state->full, "the observer summarises CUDA outputs in summary mode only");
  for (const auto& name : state->module_names) state->module_paths.push_back(name.cast<std::string>());
  state->settle_pending = true;
  state->on = true;
  frames.clear();
  leaf_depth = 0;
  state->handle = at::addThreadLocalCallback(at::RecordFunctionCallback(on_enter, on_exit)
                                                 .needsInputs(true)
                                                 .needsOutputs(true)
                                                 .scopes({at::RecordScope::FUNCTION}));
  state->installed = true;
}

void stop() {
  std::lock_guard<std::mutex> lock(records_lock);
  if (state == nullptr) return;
  if (state->installed) at::removeCallback(state->handle);
  frames.clear();
  leaf_depth = 0;
  delete state;
  state = nullptr;
}

void set_state(bool on, int module, int64_t step, bool active, bool modules_on) {
  if (state == nullptr) return;
  state->on = on;
  state->active = active;
  state->modules_on = modules_on;
  state->module = module;
  if (state->per_step && step != state->step)
    state->ordinals.restart();
  state->step = step;
}

// The records made since the last drain, as Recorder._record_one's dicts (index from `base`).
// -- the records as JSON lines, byte for byte what pydantic writes ---------------------------
// (Record.__pydantic_serializer__.to_json(record, exclude_none=True): serde_json with ryu floats,
// non-finite floats as the strings "NaN", "Infinity", "-Infinity"), so a bundle reader's fast path
// (accuracy.manifest.parse_record) takes them as its own.

// The records' text, written straight into the bytes object drain_lines returns (no copy of the
// whole text, no std::string per append): a pointer bump per piece, a capacity check before it.
class Lines {
 public:
  explicit Lines(size_t capacity) : bytes_(PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(capacity))) {
    if (bytes_ == nullptr) throw py::error_already_set();
    at_ = PyBytes_AS_STRING(bytes_);
    end_ = at_ + capacity;
  }
  Lines(const Lines&) = delete;
  Lines& operator=(const Lines&) = delete;
  ~Lines() { Py_XDECREF(bytes_); }

  template <size_t N>
  void operator+=(const char (&literal)[N]) { append(literal, literal + N - 1); }
  void operator+=(char c) {
    room(1);
    *at_++ = c;
  }
  void operator+=(const std::string& s) { append(s.data(), s.data() + s.size()); }
  void append(const std::string& s, size_t pos, size_t n) { append(s.data() + pos, s.data() + pos + n); }
  void append(const char* from, const char* to) {
    const auto n = static_cast<size_t>(to - from);
    room(n);
    std::memcpy(at_, from, n);
    at_ += n;
  }
  // A pointer to write up to n bytes at; advance() says how many were written.
  char* reserve(size_t n) {
    room(n);
    return at_;
  }
  void advance(char* to) { at_ = to; }
  size_t size() const { return static_cast<size_t>(at_ - PyBytes_AS_STRING(bytes_)); }
  // Appends a copy of the n bytes written at offset `from`.
  void repeat(size_t from, size_t n) {
    room(n);
    std::memcpy(at_, PyBytes_AS_STRING(bytes_) + from, n);
    at_ += n;
  }

  // The bytes written, as the bytes object (this buffer is empty after).
  py::bytes release() {
    if (_PyBytes_Resize(&bytes_, static_cast<Py_ssize_t>(size())) != 0) throw py::error_already_set();
    return py::reinterpret_steal<py::bytes>(std::exchange(bytes_, nullptr));
  }

 private:
  void room(size_t n) {
    if (static_cast<size_t>(end_ - at_) >= n) return;
    const size_t used = size();
    const size_t capacity = std::max(2 * static_cast<size_t>(end_ - PyBytes_AS_STRING(bytes_)), used + n);
    if (_PyBytes_Resize(&bytes_, static_cast<Py_ssize_t>(capacity)) != 0) throw py::error_already_set();
    at_ = PyBytes_AS_STRING(bytes_) + used;
    end_ = PyBytes_AS_STRING(bytes_) + capacity;
  }
  PyObject* bytes_;
  char* at_;
  char* end_;
};

template <class Text>
void json_string(Text& out, const std::string& s) {
  out += '"';
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

// A double as pydantic writes it: the shortest round-trip digits, fixed notation for decimal
// exponents in [-5, 16), "1e+20" / "1.5e-7" outside, ".0" on integral values.
void json_int(Lines& out, int64_t v) {
  char* at = out.reserve(24);
  out.advance(std::to_chars(at, at + 24, v).ptr);
}

// `v` as pydantic writes it into buf (32 chars suffice); returns the end.
char* float_chars(char* buf, double v) {
  char* o = buf;
  auto put = [&o](const char* s, size_t n) {
    std::memcpy(o, s, n);
    o += n;
  };
  if (std::isnan(v)) {
    put("\"NaN\"", 5);
    return o;
  }
  if (std::isinf(v)) {
    if (v > 0) put("\"Infinity\"", 10);
    else put("\"-Infinity\"", 11);
    return o;
  }
  if (v == 0) {
    if (std::signbit(v)) put("-0.0", 4);
    else put("0.0", 3);
    return o;
  }
  char sci[40];  // "-1.2345e+20": the shortest digits that read back as v
  const char* end = std::to_chars(sci, sci + sizeof sci, v, std::chars_format::scientific).ptr;
  const char* p = sci;
  if (*p == '-') {
    *o++ = '-';
    ++p;
  }
  char digits[24];
  int k = 0;
  for (; p < end && *p != 'e'; ++p)
    if (*p != '.') digits[k++] = *p;
  int exp10 = 0;
  std::from_chars(p + (p[1] == '+' ? 2 : 1), end, exp10);
  const int kk = exp10 + 1;  // the decimal point sits after kk digits
  if (k <= kk && kk <= 16) {
    put(digits, static_cast<size_t>(k));
    std::memset(o, '0', static_cast<size_t>(kk - k));
    o += kk - k;
    put(".0", 2);
  } else if (0 < kk && kk <= 16) {
    put(digits, static_cast<size_t>(kk));
    *o++ = '.';
    put(digits + kk, static_cast<size_t>(k - kk));
  } else if (-5 < kk && kk <= 0) {
    put("0.", 2);
    std::memset(o, '0', static_cast<size_t>(-kk));
    o += -kk;
    put(digits, static_cast<size_t>(k));
  } else {
    *o++ = digits[0];
    if (k > 1) {
      *o++ = '.';
      put(digits + 1, static_cast<size_t>(k - 1));
    }
    if (kk - 1 > 0) put("e+", 2);
    else *o++ = 'e';
    o = std::to_chars(o, o + 8, kk - 1).ptr;
  }
  return o;
}

void json_float(Lines& out, double v) { out.advance(float_chars(out.reserve(32), v)); }

void json_ints(Lines& out, const int64_t* values, size_t n) {
  out += '[';
  for (size_t i = 0; i < n; ++i) {
    if (i) out += ',';
    json_int(out, values[i]);
  }
  out += ']';
}

// A statistics row as its record's "stats" object, appended to `text`.
void row_text(Lines& text, const std::array<double, kRow>& row) {
  const auto n = static_cast<int64_t>(row[0]);  // the row's first field is numel
  for (int f = 0; f < kStatFields; ++f) {
    text += state->stat_keys[f];
    if (state->stat_count[f]) json_int(text, static_cast<int64_t>(row[f]));
    else json_float(text, row[f]);
  }
  text += ",\"sample\":[";
  const int64_t m = std::min<int64_t>(kSample, n);
  for (int64_t j = 0; j < m; ++j) {
    if (j) text += ',';
    json_float(text, row[kStatFields + j]);
  }
  text += "]}";
}

// The texts of rows formatted earlier in this drain, by the row's bytes: a row met again (a module
// output reusing its last op's row, a view's or copy's output holding the same values) repeats the
// text already written instead of formatting its floats again (~40% of the rows of a generate).
class RowTexts {
 public:
  void append(Lines& line, const Out& o) {
    // the fields its text shows: the statistics and min(numel, kSample) sampled values
    const size_t used = kStatFields + static_cast<size_t>(std::clamp<double>(o.row[0], 0, kSample));
    uint64_t words[kRow];
    std::memcpy(words, o.row.data(), used * sizeof(double));
    uint64_t h = used;
    for (size_t i = 0; i < used; ++i) {
      h = mix(h ^ words[i]);
      h ^= h >> 29;
    }
    Slot& slot = slots_[h & (kSlots - 1)];
    if (slot.used == used && std::memcmp(slot.row, o.row.data(), used * sizeof(double)) == 0) {
      line.repeat(slot.at, slot.size);
      return;
    }
    const size_t at = line.size();
    row_text(line, o.row);
    slot = {o.row.data(), used, at, line.size() - at};
  }

 private:
  static constexpr size_t kSlots = 4096;
  struct Slot {
    const double* row = nullptr;  // an Out's row, valid for the drain (the outs are cleared after it)
    size_t used = 0;  // its fields compared (0: an empty slot)
    size_t at = 0;  // its text in the lines written so far
    size_t size = 0;
  };
  std::vector<Slot> slots_ = std::vector<Slot>(kSlots);
};

// The records of State::calls/outs/ints as JSON lines (index from `base`), each ending in a newline, in
// one buffer, and their number, emptying them; `dtype_names` by c10::ScalarType code (records_lock held,
// device rows fetched).
py::tuple lines_of(int64_t base, py::dict dtype_names) {
  std::vector<std::string> dtype_of(64);
  auto dtype_name = [&](int8_t code) -> const std::string& {
    auto& slot = dtype_of.at(static_cast<size_t>(code));
    if (slot.empty()) {
      slot = "\"";
      slot += dtype_names[py::int_(code)].cast<std::string>();
      slot += '"';
    }
    return slot;
  };
  std::vector<std::string> module_json(state->module_names.size() + 1);
  static const std::array<std::string, 2> kinds = {"\"aten\"", "\"module\""};
  static const std::array<std::string, 4> formats = {"", "\"channels_last\"", "\"channels_last_3d\"", "\"strided\""};
  RowTexts row_texts;
  Lines line(state->outs.size() * 1024 + 64);  // every line, one after the other (pages untouched until written)
  int64_t count = 0;
  for (const Out& o : state->outs) {
    const Call& c = state->calls[static_cast<size_t>(o.call)];
    auto& module = module_json.at(static_cast<size_t>(c.module + 1));
    if (module.empty()) json_string(module, c.module >= 0 ? state->module_names[static_cast<size_t>(c.module)].cast<std::string>() : "");
    const std::string& op = state->names[static_cast<size_t>(c.name)];
    line += "{\"key\":\"";
    line.append(module, 1, module.size() - 2);  // escaped, unquoted
    line += '/';
    line += op;  // op names are identifiers ("aten.mm", "forward")
    line += '#';
    json_int(line, c.ordinal);
    step_suffix(line, c.step);
    line += "\",\"output\":";
    json_int(line, o.output);
    line += ",\"module\":";
    line += module;
    line += ",\"op\":\"";
    line += op;
    line += "\",\"ordinal\":";
    json_int(line, c.ordinal);
    line += ",\"kind\":";
    line += kinds[static_cast<size_t>(c.kind)];
    line += ",\"index\":";
    json_int(line, base++);
    line += ",\"input_shapes\":[";
    const int64_t* ints = state->ints.data();
    for (int64_t i = 0, at = c.in_at; i < c.n_in; ++i) {  // each input: dtype, dim, sizes
      if (i) line += ',';
      json_ints(line, ints + at + 2, static_cast<size_t>(ints[at + 1]));
      at += 2 + ints[at + 1];
    }
    line += "],\"input_dtypes\":[";
    for (int64_t i = 0, at = c.in_at; i < c.n_in; ++i) {
      if (i) line += ',';
      line += dtype_name(static_cast<int8_t>(ints[at]));
      at += 2 + ints[at + 1];
    }
    line += "],\"shape\":";
    json_ints(line, ints + o.shape_at, static_cast<size_t>(o.ndim));
    line += ",\"dtype\":";
    line += dtype_name(o.dtype);
    if (!o.tensor.empty()) {
      line += ",\"tensor\":";
      json_string(line, o.tensor);
    }
    if (o.has_row) {
      line += ",\"stats\":";
      row_texts.append(line, o);
    }
    line += ",\"step\":";
    json_int(line, c.step);
    if (o.layout != 0) {
      line += ",\"strides\":";
      json_ints(line, ints + o.shape_at + o.ndim, static_cast<size_t>(o.ndim));
      line += ",\"memory_format\":";
      line += formats[static_cast<size_t>(o.layout)];
    }
    line += "}\n";
    ++count;
  }
  state->outs.clear();
  state->calls.clear();
  state->ints.clear();
  return py::make_tuple(line.release(), count);
}

// The records made since the last drain: (their JSON lines in one buffer, their number), as lines_of.
// With `defer` (a drain inside the forward) while device rows are pending, the records are held instead
// (reading the rows would wait for the device) and (None, their number) is returned: held_lines gives
// their lines at the end, in the order deferred.
py::tuple drain_lines(int64_t base, py::dict dtype_names, bool defer) {
  std::lock_guard<std::mutex> lock(records_lock);
  if (state == nullptr) return py::make_tuple(py::bytes(), 0);
  if (defer && (state->defer_all || state->device_rows > 0)) {  // a sync now: the records wait instead
    if (state->outs.empty()) return py::make_tuple(py::bytes(), 0);
    const auto count = static_cast<int64_t>(state->outs.size());
    Held& h = state->held.emplace_back();
    h.trade();
    h.base = base;
    return py::make_tuple(py::none(), count);
  }
#ifdef OPBAND_CUDA
  fetch_device_rows();
#endif
  return lines_of(base, dtype_names);
}

// The held records' lines, one (lines, number) per deferred drain in order; the device rows are read first.
py::list held_lines(py::dict dtype_names) {
  std::lock_guard<std::mutex> lock(records_lock);
  py::list out;
  if (state == nullptr || state->held.empty()) return out;
#ifdef OPBAND_CUDA
  fetch_device_rows();
#endif
  struct Swapped {  // a held segment in State's place while its lines are written; the current one back after
    Held& h;
    explicit Swapped(Held& held) : h(held) { h.trade(); }
    ~Swapped() { h.trade(); }
  };
  for (Held& h : state->held) {
    const Swapped in_place(h);
    out.append(lines_of(h.base, dtype_names));
  }
  state->held.clear();
  return out;
}

py::dict counts() {
  py::dict d;
  if (state == nullptr) return d;
  py::dict skipped;
  for (const auto& [key, info] : state->ops) {
    if (info.name < 0) continue;
    const std::string& name = state->names[static_cast<size_t>(info.name)];
    if (info.skipped) {
      py::str k(name);
      skipped[k] = (skipped.contains(k) ? skipped[k].cast<int64_t>() : 0) + info.skipped;
    }
    if (info.backward) {
      py::str k("(backward) " + name);
      skipped[k] = (skipped.contains(k) ? skipped[k].cast<int64_t>() : 0) + info.backward;
    }
    if (info.under_mode) {
      py::str k("(traced) " + name);
      skipped[k] = (skipped.contains(k) ? skipped[k].cast<int64_t>() : 0) + info.under_mode;
    }
  }
  d["skipped"] = skipped;
  d["ops_seen"] = state->ops_seen;
  d["errors"] = state->errors;
  return d;
}

int64_t epoch() { return state == nullptr ? 0 : state->epoch; }

int scalar_type_of(const at::Tensor& t) { return static_cast<int>(t.scalar_type()); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "opband's compiled aten-level observer (see hooks/observer.py)";
  py::class_<HeldBytes>(m, "HeldBytes", py::buffer_protocol(), "a stored tensor's bytes (memoryview: flat, read-only)")
      .def_buffer([](HeldBytes& h) {
        static uint8_t none = 0;  // an empty tensor may have no data pointer
        void* data = h.values.nbytes() ? const_cast<void*>(h.values.const_data_ptr()) : &none;
        return py::buffer_info(data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.values.nbytes())}, {static_cast<py::ssize_t>(1)}, true);
      });
  m.def("start", &start, "install the observer on this thread");
  m.def("stop", &stop, "remove it and forget its state");
  m.def("set_state", &set_state, "recording on/off, the innermost module, the step, the recorder active, modules hooked",
        py::arg("on"), py::arg("module"), py::arg("step"), py::arg("active") = true, py::arg("modules_on") = true);
  module_call_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&module_call_spec));
  if (module_call_type == nullptr) throw py::error_already_set();
  m.attr("ModuleCall") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(module_call_type));
  m.def("module_call", &module_call_new, "a module's forward wrapped with the module attribution (set as its instance forward)");
  m.def("wrap_modules", &wrap_modules, "ModuleCall wrappers are installed: the stack, path -> index, the Python post-hook, torch.Tensor, the root's index");
  m.def("unwrap_modules", &unwrap_modules, "the wrappers are gone (they call through from now on)");
  m.def("json_float", [](double v) { char buf[32]; return std::string(buf, float_chars(buf, v)); },
        "a float as the record lines write it (pydantic's, for the tests)");
  m.def("drain_lines", &drain_lines, py::arg("base"), py::arg("dtype_names"), py::arg("defer") = false,
        "the records made since the last drain, as pydantic's JSON lines in one buffer, and their number; with "
        "defer, inside the forward while device rows are pending, (None, their number): they are held for held_lines");
  m.def("held_lines", &held_lines, "the deferred drains' records, (lines, number) each, in order: the device rows are read first");
  m.def("counts", &counts, "skipped calls per op, ops seen");
  m.def("record_module", &record_module, "a module's output tensors as a module record; False if Python must");
  m.def("stored_name", &stored_name, "full mode: the name of a tensor stored here that this one is, or None");
  m.def("take_writes", &take_writes, "full mode: the tensors to write since the last call");
  m.def("row_of", &row_of, "the statistics row of an output that holds the same memory, or None");
  m.def("epoch", &epoch, "ops that wrote in place so far");
  m.def("scalar_type_of", &scalar_type_of, "a tensor's c10::ScalarType code");
  m.attr("TORCH_VERSION") = OPBAND_TORCH_VERSION;  // the torch it was built against (setup.py)
#ifdef OPBAND_CUDA
  m.def("cuda_stats_row", &cuda_stats_row, "device_stats's row of a CUDA tensor, by this module's kernel (no host sync)");
  m.attr("CUDA") = true;  // summarises CUDA outputs (built with nvcc against a CUDA torch)
#else
  m.attr("CUDA") = false;
#endif
}
