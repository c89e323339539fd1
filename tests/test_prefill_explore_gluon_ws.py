"""Checks of the warp-specialised Gluon causal prefill kernel (attnbackends/triton/prefill_hopper.py) in every
config of its sweep (benchmarks/prefill_explore_gluon_ws.py), called directly; the backend's own tests
(tests/triton_backend/test_prefill_hopper.py) run its config through the public API.

CPU: every config compiles for sm_90 in fresh processes (the interpreter that the other tests use patches
triton.language in this one) with no spill stack and no spill loads/stores, the consumers and the loader within
their setmaxnreg limits, shared memory within what one block may use, wgmma and no ptxas note that it serialised
them; the barrier protocol (as a model: three coroutines under random schedules) never deadlocks or overwrites
a stage; bad arguments are refused with a clear error. GPU: every config against a float64 reference on small varlen
batches (lengths around the tile edges, 1 and 127 tokens, GQA 4 and 1, bfloat16 and float16), outputs poisoned
with NaN and a NaN guard band after the last token that must stay untouched; a launch that does not finish in
time (a barrier deadlock) ends the session with a message instead of hanging it.
"""

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ws = pytest.importorskip("benchmarks.prefill_explore_gluon_ws")

REPO = Path(__file__).resolve().parents[1]
LABELS = [ws.config_label(c) for c in ws.CONFIGS]


def test_configs_have_unique_labels_and_name_every_field():
    assert len(set(LABELS)) == len(LABELS)
    assert all(set(c) == set(ws.CONFIGS[0]) for c in ws.CONFIGS)


def test_every_config_compiles_for_sm90_without_spills_within_its_register_limits():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    groups = {}  # configs that differ in the grid only compile once, in one process
    for i, c in enumerate(ws.CONFIGS):
        groups.setdefault(repr({k: v for k, v in c.items() if k != "persistent"}), []).append(i)
    parts = [list(itertools.chain(*list(groups.values())[p::3])) for p in range(3)]  # ptxas is single-threaded
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.prefill_explore_gluon_ws", "--compile-only",
                               "--configs", ",".join(map(str, part))], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for part in parts if part]
    reports = {}
    for proc, part in zip(procs, parts):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == len(part), out[-3000:]
        reports.update(zip(part, lines))
    for i, cfg in enumerate(ws.CONFIGS):
        rep = reports[i]
        assert rep["config"] == {**cfg, "regs": list(cfg["regs"])}, rep
        assert not ws.compile_problems(rep), (ws.compile_problems(rep), rep)


class _MBarrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``passed(parity)`` is try_wait.parity (true once the phase
    of that parity has completed; a fresh barrier is in phase 0, so parity 1 passes at once)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passed(self, parity):
        return (self.phase & 1) != parity


def _protocol_model(items, nbuf, pingpong, seed):
    """The kernel's barrier protocol (see the module docstring) as three coroutines under a random schedule, TMA
    copies landing out of order and late. Asserts that every read finds the tile it expects (no stage or Q
    overwritten early), that ping-pong turns alternate, and that the schedule finishes (no deadlock)."""
    import random

    rnd = random.Random(seed)
    q_ready, q_empty = _MBarrier(1), _MBarrier(2)
    k_ready, v_ready = [_MBarrier(1) for _ in range(nbuf)], [_MBarrier(1) for _ in range(nbuf)]
    k_empty, v_empty = [_MBarrier(2) for _ in range(nbuf)], [_MBarrier(2) for _ in range(nbuf)]
    turn = [_MBarrier(1), _MBarrier(1)]
    smem = {"q": None, "k": [None] * nbuf, "v": [None] * nbuf}
    flying, turns = [], []

    def wait(bar, parity):
        while not bar.passed(parity):
            yield

    def loader():
        it = 0
        for i, n in enumerate(items):
            yield from wait(q_empty, (i & 1) ^ 1)
            flying.append((q_ready, lambda i=i: smem.__setitem__("q", i)))
            order = [("k", 0)] + [x for j in range(n) for x in ((("k", j + 1),) if j + 1 < n else ()) + (("v", j),)]
            for kind, j in order:
                g, s = it + j, (it + j) % nbuf
                yield from wait((k_empty if kind == "k" else v_empty)[s], ((g // nbuf) & 1) ^ 1)
                flying.append(((k_ready if kind == "k" else v_ready)[s],
                               lambda kind=kind, s=s, g=g: smem[kind].__setitem__(s, g)))
            it += n

    def consumer(wg):
        it = 0
        for i, n in enumerate(items):
            yield from wait(q_ready, i & 1)
            t = it + i

            def issue(k, reads):  # one turn: wait for it, issue the wgmma (they read until waited), pass it
                if pingpong:
                    yield from wait(turn[wg], (k & 1) ^ (1 - wg))
                    turns.append(wg)
                    turn[1 - wg].arrive()
                for _ in range(rnd.randint(1, 3)):
                    assert all(read() for read in reads)
                    yield

            yield from wait(k_ready[it % nbuf], (it // nbuf) & 1)
            yield from issue(t, [lambda i=i: smem["q"] == i, lambda it=it: smem["k"][it % nbuf] == it])
            k_empty[it % nbuf].arrive()
            for j in range(1, n):
                g = it + j
                yield from wait(k_ready[g % nbuf], (g // nbuf) & 1)
                yield from wait(v_ready[(g - 1) % nbuf], ((g - 1) // nbuf) & 1)
                yield from issue(t + j, [lambda i=i: smem["q"] == i, lambda g=g: smem["k"][g % nbuf] == g,
                                         lambda g=g: smem["v"][(g - 1) % nbuf] == g - 1])
                k_empty[g % nbuf].arrive()
                v_empty[(g - 1) % nbuf].arrive()
            q_empty.arrive()
            g = it + n - 1
            yield from wait(v_ready[g % nbuf], (g // nbuf) & 1)
            yield from issue(t + n, [lambda g=g: smem["v"][g % nbuf] == g])
            v_empty[g % nbuf].arrive()
            it += n

    alive = [loader(), consumer(0), consumer(1)]
    for _ in range(100_000):
        if not alive and not flying:
            break
        if flying and (not alive or rnd.random() < 0.3):
            bar, land = flying.pop(rnd.randrange(len(flying)))
            land()
            bar.arrive()
            continue
        proc = rnd.choice(alive)
        try:
            next(proc)
        except StopIteration:
            alive.remove(proc)
    else:
        raise AssertionError(f"deadlock: items {items}, nbuf {nbuf}, pingpong {pingpong}")
    assert turns == [k % 2 for k in range(len(turns))]


def test_barrier_protocol_model_never_deadlocks_or_overwrites():
    import random

    for seed in range(400):
        rnd = random.Random(seed)
        items = [rnd.randint(1, 7) for _ in range(rnd.randint(1, 5))]
        _protocol_model(items, rnd.choice([2, 3, 4]), rnd.random() < 0.5, seed)


def _cpu_args(tokens=64, heads=8, kv_heads=2, head=128, dtype=torch.bfloat16):
    q = torch.randn(tokens, heads, head).to(dtype)
    k = torch.randn(tokens, kv_heads, head).to(dtype)
    v = torch.randn(tokens, kv_heads, head).to(dtype)
    qsl = torch.tensor([0, tokens // 2, tokens], dtype=torch.int32)
    return q, k, v, torch.empty_like(q), qsl


def test_bad_register_split_is_refused():
    """(The arguments both candidates refuse: tests/test_prefill_explore_gluon.py.)"""
    q, k, v, out, qsl = _cpu_args()
    with pytest.raises(ValueError, match="regs"):
        ws.launch_args(q, k, v, out, qsl, 32, 0.1, regs=(240, 20))


def test_grid_is_one_program_per_item_or_per_sm():
    q, k, v, out, qsl = _cpu_args()
    items = q.shape[1] * 2 * 3  # heads x sequences x query blocks of max_len 300
    grid, _, kw = ws.launch_args(q, k, v, out, qsl, 300, 0.1, persistent=False)
    assert grid == (items,) and kw["num_warps"] == 4
    grid, _, _ = ws.launch_args(q, k, v, out, qsl, 300, 0.1, persistent=True)
    assert grid == (min(items, 132),)


def test_run_refuses_the_cpu():
    q, k, v, out, qsl = _cpu_args()
    with pytest.raises(NotImplementedError, match="interpreter"):
        ws.run(q, k, v, out, qsl, 32, 0.1)


def _finish(cfg: dict, timeout_s: float = 60.0) -> None:
    """Wait for the launched work; a kernel still running after ``timeout_s`` is a barrier deadlock: end the
    session (the process exit tears the CUDA context down) instead of hanging every later test."""
    ev = torch.cuda.Event()
    ev.record()
    deadline = time.time() + timeout_s
    while not ev.query():
        if time.time() > deadline:
            pytest.exit(f"{ws.config_label(cfg)}: the kernel did not finish in {timeout_s:.0f} s (deadlock)",
                        returncode=3)
        time.sleep(0.01)


TOL = {torch.bfloat16: (1e-2, 4e-2), torch.float16: (2e-3, 6e-3)}  # (relative Frobenius, max abs)
LENGTHS = [[1, 127, 128, 129, 300, 64], [513], [7, 256, 200], [1], [127], [1100, 3, 190]]


# Every config in bfloat16, the simplest schedules first (a deadlock ends the session: the configs checked before
# it are known good); float16 on the backend's config and a 64-key one (the dtype changes no control flow).
KEYS64 = next(c for c in ws.CONFIGS if c["block_n"] == 64)
CASES = [(c, torch.bfloat16) for c in sorted(ws.CONFIGS, key=lambda c: (c["pingpong"], c["persistent"]))]
CASES += [(ws.CONFIGS[0], torch.float16), (KEYS64, torch.float16)]


def _case_id(cfg: dict, dtype=None) -> str:
    return ws.config_label(cfg).replace(" ", "_").replace("/", "-") + {None: "", torch.bfloat16: "_bf16",
                                                                        torch.float16: "_fp16"}[dtype]


CASE_IDS = [_case_id(c, d) for c, d in CASES]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg,dtype", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=["mixed", "513", "three", "one_token", "127", "long"])
def test_gluon_ws_prefill_matches_float64_reference(cfg, dtype, heads, kv_heads, lengths):
    from benchmarks.prefill_explore import PagedBatch, reference

    b = PagedBatch([(n, 0) for n in lengths], num_heads=heads, num_kv_heads=kv_heads, dtype=dtype, device="cuda",
                   seed=sum(lengths) + heads)
    k, v = b.new_kv()
    T = b.num_tokens
    guard = 3
    buf = torch.full((T + guard, heads, 128), float("nan"), dtype=dtype, device="cuda")
    out = buf[:T]
    ws.run(b.query, k, v, out, b.qsl, max(lengths) + 5, b.scale, **cfg)
    _finish(cfg)
    assert torch.isnan(buf[T:]).all(), "the kernel wrote past the last token"
    assert torch.isfinite(out).all(), "rows left unwritten (NaN poison) or non-finite output"
    ref = reference(b, torch.float64)
    rel_tol, abs_tol = TOL[dtype]
    diff = out.double() - ref
    rel = float(diff.norm() / ref.norm())
    assert rel < rel_tol and float(diff.abs().max()) < abs_tol, (cfg, lengths, rel, float(diff.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [ws.CONFIGS[0], KEYS64], ids=[_case_id(ws.CONFIGS[0]), _case_id(KEYS64)])
def test_gluon_ws_prefill_repeated_launches_are_identical(cfg):
    """The persistent schedule and the barrier phases carried across work items give the same bits every launch
    (many items per program: 16 sequences x 8 query blocks x 32 heads on 132 SMs)."""
    from benchmarks.prefill_explore import PagedBatch, compare, reference

    b = PagedBatch([(1024, 0)] * 16, seed=7)
    k, v = b.new_kv()
    outs = []
    for _ in range(3):
        out = torch.full_like(b.query, float("nan"))
        ws.run(b.query, k, v, out, b.qsl, 1024, b.scale, **cfg)
        _finish(cfg)
        outs.append(out)
    assert torch.isfinite(outs[0]).all()
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    _, rel = compare(outs[0], reference(b, torch.float32))
    assert rel < TOL[torch.bfloat16][0], rel


def test_the_first_config_is_the_backends():
    import dataclasses

    from attnbackends.triton.prefill_hopper import HopperPrefillConfig

    assert ws.CONFIGS[0] == dataclasses.asdict(HopperPrefillConfig())
    assert ws.config_label(ws.CONFIGS[0]) == "ws n128 buf2 pp persist tmaO"
