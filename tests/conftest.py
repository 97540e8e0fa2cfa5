"""Shared fixtures: tiny random-init decoders (only the weights are fake), engines, references, and
for the pipeline tests a tiny model directory and a real `ray start --head` cluster."""
from __future__ import annotations

import collections
import copy
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Every Ray cluster the tests start or join uses token authentication with a session token. Set
# before anything imports ray: Ray reads its auth mode once per process.
assert "ray" not in sys.modules, "conftest must configure Ray auth before ray is imported"


def _auth_dir() -> Path:
    """The session's token folder: one per test run, shared by its pytest-xdist workers (they share one
    Ray head, `ray_head`); the first worker to get here writes the token, atomically."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        folder = Path(tempfile.mkdtemp(prefix="specpipe-ray-auth-"))
    else:
        folder = Path(tempfile.gettempdir()) / f"specpipe-ray-auth-{run}"
        folder.mkdir(mode=0o700, exist_ok=True)
    draft = folder / f"token.{os.getpid()}"
    draft.write_text(secrets.token_hex(32))
    try:
        os.link(draft, folder / "token")          # fails where another worker's token is there already
    except FileExistsError:
        pass
    draft.unlink()
    return folder


_AUTH_DIR = _auth_dir()
os.environ["RAY_AUTH_MODE"] = "token"
os.environ["RAY_AUTH_TOKEN_PATH"] = str(_AUTH_DIR / "token")
os.environ.pop("RAY_AUTH_TOKEN", None)
os.environ.pop("RAY_ADDRESS", None)

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

# Tiny models gain nothing from intra-op threads, and one thread avoids OpenMP spin-wait stalls when
# the two cores are shared with other processes.
torch.set_num_threads(1)

from pipeline.engine import (DraftingConfig, DraftModelDrafter, EngineConfig, HybridDrafter, NgramDrafter, SamplingParams,
                             SpecEngine, SuffixDrafter, SuffixParams, TreeParams)
from pipeline.engine.backends.cuda.graphs import UNCAPTURED
from pipeline.engine.model.runner import build_runner, cache_kwarg

def _missing(marker: str) -> str | None:
    """Why this machine cannot run tests marked `marker`, or None."""
    if marker == "gpu":
        return None if torch.cuda.is_available() else "needs a CUDA device (torch sees none)"
    if marker == "avx512_bf16":
        from pipeline.engine.backends.cpu.isa import cpu_flags
        return None if "avx512_bf16" in cpu_flags() else "needs a CPU with avx512_bf16 (the bf16 kernels' instructions)"
    if marker == "amx_bf16":
        from pipeline.engine.backends.cpu.isa import cpu_flags
        return None if "amx_bf16" in cpu_flags() else "needs a CPU with amx_bf16 (the AMX kernel's tiles)"
    if marker == "needs_cc":
        from pipeline.engine.backends.cpu.build import compiler
        return None if compiler() else "needs a C compiler (cc/gcc on PATH) to build our CPU kernels"
    return None


def pytest_addoption(parser):
    parser.addoption("--matrix", default="pairs", choices=("pairs", "full"),
                     help="the exactness matrix's cells (tests/engine/test_exactness_matrix.py): a pairwise "
                          "covering array (pairs, the default) or the whole product (full)")


COLLECTED = pytest.StashKey[list]()      # every test collected, before -m / -k deselect any (test_tiers.py)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Markers gpu, avx512_bf16, amx_bf16 and needs_cc skip with the reason in the skip summary (-ra)."""
    config.stash[COLLECTED] = list(items)
    reasons = {m: _missing(m) for m in ("gpu", "avx512_bf16", "amx_bf16", "needs_cc")}
    for item in items:
        for marker, reason in reasons.items():
            if reason and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {reason}"))


_EXIT_STATUS = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The verdict is printed and final here: exit with it, skipping the interpreter's finalization.
    Native threads left by libraries the suite drives in-process (Ray's core worker after a driver
    connected and shut down, OpenMP pools) have crashed that finalization intermittently: SIGSEGV
    in libc's memcpy on a non-main thread after every test had passed (exit 139), which turns a
    green run red for no fault of the code under test. SPECPIPE_TEST_FINALIZE=1 runs it anyway
    (to chase that crash)."""
    status = config.stash.get(_EXIT_STATUS, None)
    if status is not None and os.environ.get("SPECPIPE_TEST_FINALIZE") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


DRAFTERS = ["none", "ngram", "suffix", "draft-greedy", "draft-prob", "hybrid"]


def tiers(values, fast) -> list:
    """A slow grid's parameter values: those in `fast` run in the fast tier too (`-m "not slow"`), the
    rest only in the whole suite."""
    return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]


def tiny_llama(vocab: int = 512, seed: int = 0, init_range: float = 0.7, layers: int = 2,
               hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights. init_range 0.5-1.0 gives varied tokens and few near-ties."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=1024, initializer_range=init_range, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with the target often but not always."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise)
    return draft


def make_drafter(kind: str, draft_model, num_slots: int, max_len: int, min_n: int = 1, max_n: int = 3,
                 compile: str = "off", cpu_attention: str = "auto", cpu_linear: str = "auto",
                 cpu_decoder: str = "auto", cuda_graphs: str = "auto", tree: TreeParams = TreeParams(),
                 linear_plan=None):
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter(min_n, max_n, tree=tree)
    if kind in ("suffix", "suffix-greedy", "suffix-own"):   # min_match 1 (like min_n): tiny random models
        # rarely repeat 2-grams; suffix-own: the sequence's own text only (no worker-wide index)
        return SuffixDrafter(SuffixParams(min_match=1, sample_method="greedy" if kind == "suffix-greedy"
                                          else "probabilistic", max_cached_tokens=0 if kind == "suffix-own"
                                          else SuffixParams.max_cached_tokens), tree=tree)
    method = "probabilistic" if kind in ("draft-prob", "hybrid-suffix-prob") else "greedy"
    model_drafter = DraftModelDrafter(build_runner(copy.deepcopy(draft_model), num_slots, max_len, compile=compile,
                                                  cpu_attention=cpu_attention, cpu_linear=cpu_linear,
                                                  cpu_decoder=cpu_decoder, cuda_graphs=cuda_graphs,
                                                  linear_plan=linear_plan), method)
    if kind in ("hybrid-suffix", "hybrid-suffix-prob"):   # suffix drafts sampled from counts where sampling
        return HybridDrafter(SuffixDrafter(SuffixParams(min_match=1)), model_drafter)
    return HybridDrafter(NgramDrafter(min_n, max_n), model_drafter) if kind == "hybrid" else model_drafter


def drafting_method(kind: str) -> str:
    """drafting.method of a make_drafter kind (its suffix- and draft- variants are suffix and draft)."""
    return next(m for m in ("none", "ngram", "suffix", "draft", "hybrid") if kind.startswith(m))


def make_engine(target, kind="none", draft_model=None, max_num_seqs=4, max_model_len=256, g=4,
                adaptive=False, eos=(), decode=None, max_prefill_tokens=512, compile="off", cpu_attention="auto",
                cpu_linear="auto", prefix_reuse=True, cpu_decoder="auto", cuda_graphs="auto", grammars=None,
                forced_tokens=True, tree: TreeParams = TreeParams(), linear_plan=None, target_switches=None,
                run_ahead="auto", tp=None):
    """An engine over copies of the models. Attention: every forward takes our CPU kernel
    (cpu_attention="auto", cpu_attention.py) unless cpu_attention="off"; then compile="on" takes the
    compiled FlexAttention path and compile="off" torch's padded SDPA. Linears: the plan measured on
    this machine (cpu_linear="auto", cpu/calibrate.py), our panel kernel everywhere ("on"), oneDNN's
    packed linear ("off"), or `linear_plan` (a LinearPlan) for every family. The forward: one loop over those
    kernels where they are all in use (cpu_decoder="auto", cpu_decoder.py), else the model's modules.
    CUDA graphs (cuda_graphs.py): auto captures them on CUDA; "uncaptured" runs their padded, bucketed
    forward without capturing (where neither CPU kernel is in use), how the CPU tests check that path.
    tree: token trees from the ngram and suffix drafters (TreeParams.max_tokens > 0). target_switches: more
    of the target runner's Kernels switches (model/plan.py). run_ahead: engine.run_ahead ("on" with
    "uncaptured" graphs runs steps ahead on CPU). tp: `target` is rank 0's shard of a tensor-parallel
    replica (tp_util.Replica)."""
    drafter = make_drafter(kind, draft_model, max_num_seqs, max_model_len, compile=compile, cpu_attention=cpu_attention,
                           cpu_linear=cpu_linear, cpu_decoder=cpu_decoder, cuda_graphs=cuda_graphs, tree=tree,
                           linear_plan=linear_plan)
    cfg = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens,
                       compile=compile, prefix_reuse=prefix_reuse, run_ahead=run_ahead,
                       cuda_graphs="off" if cuda_graphs == UNCAPTURED else cuda_graphs)
    # The runner regroups its model's linears in place on CPU (cpu/linear.py): it gets its own copy, so
    # the test's model stays the plain Hugging Face reference (generate, top-2 gaps).
    return SpecEngine(build_runner(copy.deepcopy(target), max_num_seqs, max_model_len, compile=compile,
                                   cpu_attention=cpu_attention, cpu_linear=cpu_linear, cpu_decoder=cpu_decoder,
                                   cuda_graphs=cuda_graphs, linear_plan=linear_plan, tp=tp, **(target_switches or {})),
                      drafter, cfg, list(eos), decode,
                      drafting=DraftingConfig(method=drafting_method(kind), num_speculative_tokens=g, adaptive=adaptive,
                                              forced_tokens=forced_tokens, tree=tree),
                      grammars=grammars)


def run_requests(engine, prompts, params, arrive_every: int = 0, seeds=None, ids=None):
    """Run prompts through the engine. With arrive_every > 0 the first half is queued up front and
    the rest arrive one per `arrive_every` steps, while others are decoding. Returns
    ({id: Completion}, [RoundRecord], per-step callback results)."""
    ids = ids or [str(i) for i in range(len(prompts))]
    seeds = seeds or [0] * len(prompts)
    pending = list(zip(ids, prompts, seeds))
    upfront = len(pending) // 2 if arrive_every else len(pending)
    for rid, p, s in pending[:upfront]:
        engine.add_request(rid, p, params, seed=s)
    pending = pending[upfront:]
    done, rounds, step = {}, [], 0
    while engine.has_unfinished() or pending:
        if pending and (step % max(arrive_every, 1) == 0):
            rid, p, s = pending.pop(0)
            engine.add_request(rid, p, params, seed=s)
        out = engine.step()
        rounds.extend(out.rounds)
        done.update({c.request_id: c for c in out.finished})
        step += 1
    return done, rounds


@torch.no_grad()
def greedy_reference(model, prompt: list[int], max_new: int) -> list[int]:
    """Target-only greedy decoding by Hugging Face `generate` (its own DynamicCache path), on the
    model's device."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def dynamic_cache_keys(model, tokens: list[int]) -> torch.Tensor:
    """Layer-0 keys of an uncached forward of `tokens` through HF's own DynamicCache: [kv_heads, n, dim].
    The cache goes in by the keyword this transformers release takes (cache_kwarg: 5.17 silently
    ignores an unknown `cache=` and would leave the reference empty)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([tokens], device=model.device), use_cache=True, **{cache_kwarg(model): cache})
    return cache.layers[0].keys[0]


@torch.no_grad()
def top2_gap(model, tokens: list[int]) -> float:
    """Gap between the two largest next-token logits after `tokens` (uncached, fp64 head)."""
    hidden = model.model(input_ids=torch.tensor([tokens], device=model.device)).last_hidden_state[0, -1]
    logits = model.lm_head.weight.double() @ hidden.double()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed lengths (1..60); a third repeat a motif so n-gram lookup finds matches."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.choice([1, 2, 5, 9, 17, 33, 60])
        if i % 3 == 0 and length >= 9:
            motif = [rng.randrange(vocab) for _ in range(4)]
            prompts.append((motif * length)[:length])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
    return prompts


def mixed_prompts_fixture(n: int, seed: int):
    """A module's `prompts` fixture: mixed_prompts(n, target_model's vocabulary, seed)."""
    @pytest.fixture(scope="module")
    def prompts(target_model):
        return mixed_prompts(n, target_model.config.vocab_size, seed=seed)
    return prompts


def greedy_references_fixture(max_new: int, model: str = "target_model"):
    """A module's `references` fixture: greedy_reference of each of its `prompts`, max_new tokens, by
    the fixture named `model`."""
    @pytest.fixture(scope="module")
    def references(request, prompts):
        reference_model = request.getfixturevalue(model)
        return [greedy_reference(reference_model, p, max_new) for p in prompts]
    return references


NEAR_TIE = 1e-3     # a top-2 logit gap this small may flip under another order of fp32 rounding


def near_tie_mismatches(model, prompts, outputs, references, gap=None) -> int:
    """How many outputs differ from their greedy reference. Each must have the reference's length
    and first differ on a near-tie of model's top-2 logits (below NEAR_TIE), or the assertion fails.
    gap: tokens -> that top-2 gap (default top2_gap, for models of the Llama layout)."""
    gap = gap or (lambda tokens: top2_gap(model, tokens))
    mismatches = 0
    for i, (prompt, out, ref) in enumerate(zip(prompts, outputs, references)):
        assert len(out) == len(ref), f"prompt {i}: {len(out)} tokens, expected {len(ref)}"
        if out != ref:
            mismatches += 1
            j = next(j for j, (a, b) in enumerate(zip(out, ref)) if a != b)
            tie = gap(prompt + ref[:j])
            assert tie < NEAR_TIE, f"prompt {i}: first difference at {j} with top-2 gap {tie:.2e} (not a tie)"
    return mismatches


def sample_outputs(engine, prompt: list[int], params, n: int, seed: int) -> tuple[dict[tuple, int], list]:
    """n requests of one prompt ("r0", "r1", ...: each samples from its own generators, seeded from
    `seed` and its id), all queued up front: (counts of whole outputs, every RoundRecord)."""
    done, rounds = run_requests(engine, [prompt] * n, params, seeds=[seed] * n, ids=[f"r{i}" for i in range(n)])
    counts = collections.Counter(tuple(c.output_ids) for c in done.values())
    assert sum(counts.values()) == n
    return counts, rounds


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama()


def _plain_layers(model) -> bool:
    """Whether a model's decoder layers are still Hugging Face's own (no runner regrouped them in place)."""
    return all(hasattr(layer.mlp, "gate_proj") and type(layer.mlp.gate_proj) is torch.nn.Linear
               for layer in model.model.layers)


@pytest.fixture(autouse=True)
def _shared_models_stay_plain(request):
    """The session's models are the references every later test compares with: a test that hands one to
    a runner itself (which regroups linears in place) instead of a copy fails here, not in a later test."""
    yield
    for name in ("target_model", "draft_model"):
        if name in request.fixturenames:
            assert _plain_layers(request.getfixturevalue(name)), f"{name} was changed in place: give runners a copy"


@pytest.fixture(scope="session")
def draft_model(target_model):
    return noisy_copy(target_model, noise=0.05)


@pytest.fixture(scope="module")
def enumerable_models():
    """A target over 8 tokens (references.TINY_TOKENS' size), small enough to enumerate every short
    output, at init range 0.15 (no token dominates), and a draft near it."""
    target = tiny_llama(vocab=8, seed=5, init_range=0.15)
    return target, noisy_copy(target, noise=0.15, seed=6)


# ---- pipeline fixtures ------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random-init Llama (fp32 safetensors) with the real SmolLM2 tokenizer and chat
    template: real text prompts, fake weights. Greedy outputs are varied (init range 0.7)."""
    from pipeline.loading.models import resolve_hf_dir
    src = resolve_hf_dir("smollm2-135m-instruct")
    out = tmp_path_factory.mktemp("tiny-smollm")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    tiny_llama(vocab=49152, layers=2, hidden=64).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayHead:
    """A real `ray start --head` on loopback, token auth on (the session token), dashboard and job
    API on 127.0.0.1 only.

    Started with `--block` in its own process group so that `stop()` ends exactly this head's
    processes (the `ray start` process tears down its GCS, raylet, dashboard and workers on SIGTERM),
    never other Ray processes on the machine as `ray stop` would. Its own `--temp-dir`: the job API
    gives a submitted driver the address in `<temp-dir>/ray_current_cluster`, which with the shared
    /tmp/ray is whichever head on this machine started last (another test session's, another token).

    Note: Ray replaces `--node-ip-address 127.0.0.1` with the host's routable IP (GCS and raylet
    advertise it); only the dashboard/job API is pinned to loopback by `--dashboard-host`.

    `metrics_export_port` fixes the node's Prometheus endpoint (`--metrics-export-port`); `env` adds
    variables for the head and the workers it starts (e.g. `RAY_metrics_report_interval_ms`)."""

    def __init__(self, num_cpus: int = 4, timeout: float = 180.0, metrics_export_port: int | None = None,
                 env: dict | None = None):
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        bin_dir = os.path.dirname(sys.executable)
        # metrics reported every second (Ray: 10 s): a job's end waits one report interval for them
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
                    "RAY_metrics_report_interval_ms": "1000", **(env or {})}
        self.ray = os.path.join(bin_dir, "ray")
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")     # short: Ray's socket paths live here
        cmd = [self.ray, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port",
               str(self.gcs_port), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
               "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
               "--num-cpus", str(num_cpus), "--disable-usage-stats", "--include-dashboard", "true",
               "--temp-dir", self.temp_dir]
        if metrics_export_port is not None:     # the node's Prometheus endpoint (else Ray picks a port)
            cmd += ["--metrics-export-port", str(metrics_export_port)]
        self.log_path = Path(self.temp_dir) / "ray-start.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        """Until the job API answers an authenticated request (the dashboard starts after `ray start`
        has brought up GCS and raylet)."""
        import urllib.error
        import urllib.request
        token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
        request = urllib.request.Request(f"{self.dashboard_url}/api/jobs/",
                                         headers={"Authorization": f"Bearer {token}"})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Ray head not ready after {timeout:.0f} s:\n{self.log()}")
            time.sleep(1.0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """SIGTERM to our `ray start --block` (it kills the processes it started); anything of our
        process group still alive afterwards is killed by pid."""
        import signal
        terminate(self.proc, grace=10)              # then the group is killed: a test run's head, no data
        for pid in _process_group_members(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def terminate(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM, then SIGKILL if it is still running after `grace` seconds."""
    import signal
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def _process_group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid` (Linux /proc)."""
    return proc_members(pgrp=pgid)


def proc_members(pgrp: int | None = None, session: int | None = None) -> list[int]:
    """Live (non-zombie) processes in a process group or session, from /proc/<pid>/stat."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after "pid (comm) ": state ppid pgrp session ...
        if fields[0] != "Z" and (pgrp is None or int(fields[2]) == pgrp) \
                and (session is None or int(fields[3]) == session):
            pids.append(int(entry.name))
    return pids


class SharedHead:
    """A RayHead started by one pytest-xdist worker and joined by the others (the fields tests read);
    the last worker to leave stops it. An idle head costs ~0.13 of a core (its raylet, GCS and
    dashboard processes): one per run, not one per worker."""

    def __init__(self, state: dict):
        self.address, self.dashboard_url, self.ray = state["address"], state["dashboard_url"], state["ray"]
        self.env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}


def stop_head_group(pid: int, temp_dir: str, grace: float = 10) -> None:
    """SIGTERM to a `ray start --block` by pid (started by another process), then SIGKILL to what is
    left of its process group, and its temp dir removed."""
    import signal
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and pid in _process_group_members(pid):
        time.sleep(0.2)
    for member in _process_group_members(pid):
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory, worker_id):
    """One `ray start --head` for the run: in one process, its own; under pytest-xdist, shared by the
    workers through a state file beside their temp dirs (logical CPUs 4 per worker, so concurrent jobs
    of different workers are placed as on a head of their own)."""
    if worker_id == "master":
        head = RayHead()
        yield head
        head.stop()
        return
    import json

    from filelock import FileLock
    root = tmp_path_factory.getbasetemp().parent
    state_path, lock = root / "ray_head.json", FileLock(str(root / "ray_head.lock"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    with lock:
        state = json.loads(state_path.read_text()) if state_path.exists() else None
        if state is None or state["pid"] not in _process_group_members(state["pid"]):
            head = RayHead(num_cpus=4 * workers)
            state = {"address": head.address, "dashboard_url": head.dashboard_url, "ray": head.ray,
                     "pid": head.proc.pid, "temp_dir": head.temp_dir, "users": 0}
        state["users"] += 1
        state_path.write_text(json.dumps(state))
    yield SharedHead(state)
    with lock:
        state = json.loads(state_path.read_text())
        state["users"] -= 1
        if state["users"] == 0:
            stop_head_group(state["pid"], state["temp_dir"])
            state_path.unlink()
        else:
            state_path.write_text(json.dumps(state))


__all__ = ["SamplingParams"]
