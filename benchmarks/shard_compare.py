"""Sharded comparisons: one large comparison finished by 1 worker vs 2 workers (not a test).

Run: ``.venv/bin/python benchmarks/shard_compare.py [--rounds 3] [--tensors 32] [--numel 8388608] [--records 640]``.

Writes (once, in a temporary directory) a float32 reference and a target bundle of ``--records``
records over ``--tensors`` distinct tensors of ``--numel`` elements per side (records share tensors:
the kernels read ``records x numel x 4`` bytes per side, which would not fit the page cache of this
shared machine as distinct tensors; the bytes on disk are printed too). Every record names another
(reference, target) pair of tensors (reference ``i % tensors``, target ``(i + i // tensors) % tensors``;
the tensors are one base array plus small distinct noise, so every pairing differs by a realistic
~1e-3): ``compare`` measures a pair of stored tensors once for all records that name it, and pairs
repeated across records would not be judged again. It stores them in a service (SQLite, blob folder) and, in interleaved rounds, times from
queueing to ``done`` (real ``opband worker`` processes, started before each timing and idle):

- ``1 worker``: the comparison unsharded (``shards=1``): what a single worker did before sharding;
- ``1 worker, sharded``: the same split into ``--shards`` shards (what sharding costs on one worker);
- ``2 workers, sharded``: split, judged by two workers, merged by one.

Twice: with each worker pinned to one CPU (``taskset``-style affinity: a fleet where a worker is one
CPU, the premise of the goal, and the metric kernels run one thread per worker) and unpinned (the
kernels of one worker already use every CPU of this 2-core machine for large tensors). Prints the
median of each, the speed-up ratio 1 worker / 2 workers, GB/s of tensor bytes judged, the CPU
seconds the workers spent (their process trees) and the machine spent (all processes, /proc/stat) per run,
and the load average: on a machine others use too, the workers' CPUs per second of wall time show how
much of the 2 CPUs they got.
Goal (issue 14): 2 workers >= 1.7x faster than 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accuracy.bundle import BundleWriter  # noqa: E402
from accuracy.manifest import Manifest, Record  # noqa: E402


def write_bundle(path: Path, tensors: int, numel: int, records: int, target: bool) -> Path:
    if records > tensors * tensors:
        raise SystemExit(f"--records {records} needs at least {int(np.ceil(np.sqrt(records)))} --tensors (distinct pairs)")
    recs = []
    base = np.random.default_rng(0).standard_normal(numel, dtype=np.float32)
    with BundleWriter(path) as w:
        for i in range(tensors):
            v = base + np.float32(1e-3) * np.random.default_rng(1 + i).standard_normal(numel, dtype=np.float32)
            if target:
                v += np.float32(2e-3) * np.random.default_rng(10_000 + i).standard_normal(numel, dtype=np.float32)
            w.add_array(f"t{i}", v)
        for i in range(records):
            module = f"model.layers.{i}"
            recs.append(Record(key=f"{module}/aten.mm#0", module=module, op="aten.mm", ordinal=0, index=i,
                               input_shapes=[[numel]], input_dtypes=["float32"], shape=[numel], dtype="float32",
                               tensor=f"t{(i + i // tensors) % tensors if target else i % tensors}"))
        return w.close(Manifest(run={"variant": "fp32", "device": "cpu", "level": "aten", "mode": "full"},
                                environment={"torch": "2", "device": "cpu", "threads": 2}, records=recs))


def cpu_busy_seconds() -> float:
    """CPU seconds spent by every process of the machine so far (user + nice + system + irq + softirq)."""
    fields = open("/proc/stat").readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def tree_cpu(roots: list[int], seen: dict[int, float]) -> None:
    """Record the CPU seconds (user + system) of every live process under ``roots`` into ``seen``
    (a job's process is sampled until it ends: the last sample is kept)."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            rest = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(entry)] = int(rest[1])
        cpu[int(entry)] = (int(rest[11]) + int(rest[12])) / tick
    mine = set(roots)
    grew = True
    while grew:
        more = {pid for pid, pp in parent.items() if pp in mine} - mine
        grew = bool(more)
        mine |= more
    for pid in mine:
        if pid in cpu:
            seen[pid] = max(seen.get(pid, 0.0), cpu[pid])


class Bench:
    def __init__(self, root: Path) -> None:
        from api.store.db import upgrade

        self.root, self.data_dir = root, root / "data"
        self.url = f"sqlite:///{root / 'opband.db'}"
        upgrade(self.url)
        from api.services import Services
        from api.settings import Settings

        self.svc = Services.open(Settings(database_url=self.url, data_dir=self.data_dir, workers=0))
        self.cpus = sorted(os.sched_getaffinity(0))

    def store(self, path: Path) -> str:
        from api.auth import get_or_create_project
        from api.store.ingest import SpooledUpload, store_bundle

        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        spool = self.root / f"{uuid.uuid4().hex}.up"
        shutil.copy(path, spool)
        proj = get_or_create_project(self.svc.db, "bench")
        return store_bundle(self.svc.db, self.svc.store, proj,
                            SpooledUpload(spool, digest.hexdigest(), path.stat().st_size))[0].id

    def workers(self, n: int, pinned: bool) -> list[subprocess.Popen[bytes]]:
        env = {**os.environ, "OPBAND_DATABASE_URL": self.url, "OPBAND_DATA_DIR": str(self.data_dir),
               "OPBAND_QUEUE": "database", "OPBAND_WORKERS": "0"}
        procs, logs = [], []
        for i in range(n):
            cpu = {self.cpus[i % len(self.cpus)]}

            def pin(cpu: set[int] = cpu) -> None:
                os.sched_setaffinity(0, cpu)

            logs.append(self.root / f"worker-{uuid.uuid4().hex[:8]}.log")
            cmd = [sys.executable, "-m", "opband.cli", "worker", "--data-dir", str(self.data_dir)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=open(logs[-1], "wb"), stderr=subprocess.STDOUT,
                                          preexec_fn=pin if pinned else None))
        deadline = time.monotonic() + 120
        while not all('"worker started"' in log.read_text() for log in logs):  # its job processes are ready
            if time.monotonic() > deadline:
                raise SystemExit("workers did not start: " + " | ".join(log.read_text()[-2000:] for log in logs))
            time.sleep(0.1)
        time.sleep(1.0)  # idle (polling) before the clock starts
        self.logs = logs
        return procs

    def run(self, ref: str, tgt: str, workers: int, shards: int,
            pinned: bool) -> tuple[float, float, float, float, int]:
        """Seconds from queueing to done; machine CPU seconds, the workers' CPU seconds and the busiest worker's
        meanwhile; shards."""
        from api.store.models import Comparison

        procs = self.workers(workers, pinned)
        try:
            cid = uuid.uuid4().hex
            before: list[dict[int, float]] = [{} for _ in procs]
            for p, b in zip(procs, before, strict=True):
                tree_cpu([p.pid], b)
            seen = [dict(b) for b in before]
            cpu0 = cpu_busy_seconds()
            with self.svc.db.session() as s:
                s.add(Comparison(id=cid, project_id=self._project(), reference_id=ref, target_id=tgt, shards=shards))
            while True:  # watched at 4 Hz: this loop's own CPU (queries, /proc scans) must not slow the workers
                with self.svc.db.session() as s:
                    c = s.get(Comparison, cid)
                    assert c is not None
                    status, error, used = c.status, c.error, c.shards_done
                    created, finished = c.created_at, c.finished_at
                if status in ("done", "failed"):
                    break
                for p, b in zip(procs, seen, strict=True):
                    tree_cpu([p.pid], b)
                time.sleep(0.25)
            cpu = cpu_busy_seconds() - cpu0
            wall = (finished - created).total_seconds()  # the row's own times: queued to done, not when we looked
            for p, b in zip(procs, seen, strict=True):
                tree_cpu([p.pid], b)
            each = [sum(a.values()) - sum(b.values()) for a, b in zip(seen, before, strict=True)]
            if status != "done":
                raise SystemExit(f"comparison failed: {error}")
            return wall, cpu, sum(each), max(each), used or 1
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(60)

    def _project(self) -> int:
        from api.auth import get_or_create_project

        return get_or_create_project(self.svc.db, "bench").id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=32, help="distinct tensors per bundle")
    ap.add_argument("--numel", type=int, default=8 << 20, help="elements per tensor")
    ap.add_argument("--records", type=int, default=640, help="records per bundle (they share the tensors)")
    ap.add_argument("--shards", type=int, default=None, help="shards of the sharded runs (default: the service's "
                    "OPBAND_SHARD_COUNT default)")
    ap.add_argument("--modes", default="pinned,unpinned")
    args = ap.parse_args()
    if args.shards is None:
        from api.settings import Settings

        args.shards = Settings.model_fields["shard_count"].default
    root = Path(tempfile.mkdtemp(prefix="opband-shard-bench-"))
    try:
        t = time.perf_counter()
        ref_path = write_bundle(root / "ref.bundle", args.tensors, args.numel, args.records, target=False)
        tgt_path = write_bundle(root / "tgt.bundle", args.tensors, args.numel, args.records, target=True)
        on_disk = ref_path.stat().st_size + tgt_path.stat().st_size
        judged = 2 * args.records * args.numel * 4
        bench = Bench(root)
        ref, tgt = bench.store(ref_path), bench.store(tgt_path)
        print(f"bundles: {on_disk / 1e9:.2f} GB on disk, {judged / 1e9:.1f} GB of tensors judged per comparison "
              f"({args.records} records x {args.numel} float32 per side), written in {time.perf_counter() - t:.1f} s; "
              f"{len(bench.cpus)} CPUs; load {os.getloadavg()[0]:.2f}", flush=True)
        configs = [("1 worker", 1, 1), ("1 worker, sharded", 1, args.shards), ("2 workers, sharded", 2, args.shards)]
        for mode in args.modes.split(","):
            pinned = mode == "pinned"
            bench.run(ref, tgt, 1, 1, pinned)  # warm: page cache, numba cache
            times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
            cpus: dict[str, list[float]] = {name: [] for name, _, _ in configs}
            owns: dict[str, list[float]] = {name: [] for name, _, _ in configs}
            busiest: dict[str, list[float]] = {name: [] for name, _, _ in configs}
            loads = []
            for r in range(args.rounds):
                order = configs if r % 2 == 0 else configs[::-1]  # interleaved, alternating order
                for name, workers, shards in order:
                    loads.append(os.getloadavg()[0])
                    wall, cpu, own, most, used = bench.run(ref, tgt, workers, shards, pinned)
                    busiest[name].append(most)
                    times[name].append(wall)
                    cpus[name].append(cpu)
                    owns[name].append(own)
                    print(f"  [{mode}] round {r + 1} {name:<20} {wall:7.2f} s  {judged / wall / 1e9:5.2f} GB/s  "
                          f"workers' CPU {own:6.1f} s ({own / wall:4.2f} CPUs)  machine CPU {cpu:6.1f} s  "
                          f"shards {used}  load {loads[-1]:.2f}", flush=True)
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{mode}: " + "; ".join(f"{k} {v:.2f} s ({judged / v / 1e9:.2f} GB/s, workers' CPU "
                                          f"{statistics.median(owns[k]):.1f} s, machine CPU "
                                          f"{statistics.median(cpus[k]):.1f} s)" for k, v in med.items()))
            print(f"{mode}: speed-up 2 workers vs 1 worker = {med['1 worker'] / med['2 workers, sharded']:.2f}x "
                  f"(vs 1 worker sharded: {med['1 worker, sharded'] / med['2 workers, sharded']:.2f}x; "
                  f"sharding overhead on 1 worker {med['1 worker, sharded'] / med['1 worker']:.3f}x); "
                  f"load average during the runs {min(loads):.2f}-{max(loads):.2f}  (goal >= 1.7x)", flush=True)
            one, two = statistics.median(owns["1 worker"]), statistics.median(busiest["2 workers, sharded"])
            print(f"{mode}: from CPU time (what external load does not change): 1 worker {one:.1f} CPU s, the busier "
                  f"of 2 workers {two:.1f} CPU s: speed-up with a free CPU per worker ~{one / two:.2f}x", flush=True)
        bench.svc.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
