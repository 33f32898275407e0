"""The sim test double's parts: token function, context store, latency model, config."""

from __future__ import annotations

from pathlib import Path

import pytest
from drs_engine.backends.sim import stream as sim_stream
from drs_engine.backends.sim.model import TokenFunction, weights_seed
from drs_engine.backends.sim.weights import SimWeights, hash_weights_path, read_weights_path
from drs_engine.config import SimSpec, build_config, load_config_file
from drs_engine.errors import WeightsLoadError
from drs_engine.kv_store import ContextState, ContextStore
from drs_engine.latency import LatencyModel
from drs_engine.prefix_hash import block_hashes
from drs_protocol.weights_digest import digest_files
from drs_protocol.weights_stream import WeightsStreamHeader
from hypothesis import given
from hypothesis import strategies as st


def function(version: str = "v1", *, block: int = 4, eos: float = 0.0) -> TokenFunction:
    return TokenFunction(
        weights_seed(version, b"w"), vocab_size=1000, eos_token_id=1000, eos_probability=eos, tokens_per_block=block
    )


def generate(fn: TokenFunction, prompt: list[int], n: int) -> list[int]:
    state = fn.start(prompt)
    out = []
    for _ in range(n):
        token = fn.next_token(state).token_id
        out.append(token)
        fn.advance(state, token)
    return out


@given(st.lists(st.integers(0, 999), min_size=1, max_size=30), st.integers(1, 12))
def test_continuing_a_state_equals_starting_from_the_longer_prefix(prompt: list[int], n: int) -> None:
    fn = function()
    generated = generate(fn, prompt, n)
    assert generate(fn, [*prompt, *generated[:-1]], 1) == generated[-1:]
    state = fn.start(prompt)
    for token in generated:
        fn.advance(state, token)
    assert state.chain == fn.start([*prompt, *generated]).chain


def test_tokens_depend_on_the_weights_and_on_every_prefix_token() -> None:
    prompt = list(range(50))
    base = generate(function("v1"), prompt, 8)
    assert generate(function("v1"), prompt, 8) == base
    assert generate(function("v2"), prompt, 8) != base
    assert generate(function("v1"), [999, *prompt[1:]], 8) != base  # first token differs: a different chain


def test_eos_is_emitted_at_the_configured_rate() -> None:
    fn = function(eos=0.5)
    picks = [fn.next_token(fn.start([i])).token_id for i in range(400)]
    assert 120 < picks.count(1000) < 280
    assert all(fn.next_token(fn.start([i]), allow_eos=False).token_id != 1000 for i in range(50))


def test_top_logprobs_start_with_the_chosen_token_and_decrease() -> None:
    fn = function()
    choice = fn.next_token(fn.start([1, 2, 3]), top_logprobs=4)
    assert choice.top_logprobs[0] == (choice.token_id, choice.logprob)
    values = [lp for _, lp in choice.top_logprobs]
    assert values == sorted(values, reverse=True) and len(values) == 4


def test_block_hashes_cover_only_full_blocks() -> None:
    seed = weights_seed("v", b"")
    assert len(block_hashes(seed, list(range(11)), 4)) == 2
    assert block_hashes(seed, list(range(8)), 4) == block_hashes(seed, list(range(11)), 4)


def state(ctx_request_id: int) -> ContextState:
    return ContextState(ctx_request_id, [1, 2], 3, -0.5, [(3, -0.5)], "00" * 16, [1, 2], "d", "v", 0)


def test_a_context_state_is_taken_once() -> None:
    store: ContextStore[ContextState] = ContextStore(capacity=10, ttl_seconds=60)
    store.put(state(1))
    assert store.take(1) == state(1)
    assert store.take(1) is None


def test_context_states_expire_and_the_oldest_goes_first_when_full() -> None:
    now = [0.0]
    store: ContextStore[ContextState] = ContextStore(capacity=2, ttl_seconds=10, clock=lambda: now[0])
    store.put(state(1))
    now[0] = 5
    store.put(state(2))
    store.put(state(3))  # over capacity: 1 goes
    assert store.take(1) is None
    now[0] = 12  # 2 and 3 were stored at t=5 with a 10 s TTL: alive until t=15
    assert len(store) == 2
    now[0] = 15
    assert store.take(2) is None and store.take(3) is None


def test_states_leaving_unfetched_are_handed_to_on_drop_and_taken_ones_are_not() -> None:
    now = [0.0]
    dropped: list[int] = []
    store: ContextStore[ContextState] = ContextStore(
        capacity=2, ttl_seconds=10, clock=lambda: now[0], on_drop=lambda s: dropped.append(s.ctx_request_id)
    )
    store.put(state(1))
    store.put(state(2))
    store.put(state(3))  # over capacity: 1 is evicted
    assert store.take(2) == state(2) and dropped == [1]
    now[0] = 11
    assert len(store) == 0 and dropped == [1, 3]  # 3 expired
    store.put(state(4))
    assert store.clear() == 1 and dropped == [1, 3, 4]


def test_a_context_state_survives_the_wire() -> None:
    original = state(2**41 + 3)
    assert ContextState.from_wire(original.to_wire()) == original


def test_decode_steps_slow_down_with_batch_size_and_speed_zero_never_sleeps() -> None:
    model = LatencyModel.from_spec(SimSpec(speed=1.0))
    assert model.decode_step_seconds(64) > model.decode_step_seconds(1) > 0
    assert model.prefill_seconds(1000) == pytest.approx(1000 * SimSpec().prefill_seconds_per_token)
    still = LatencyModel.from_spec(SimSpec(speed=0))
    assert still.decode_step_seconds(64) == still.prefill_seconds(10**6) == still.weights_load() == 0


def test_weights_hashes_follow_the_content(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(b"1")
    first = hash_weights_path(str(tmp_path / "a"))
    (tmp_path / "a" / "w.bin").write_bytes(b"2")
    assert hash_weights_path(str(tmp_path / "a")) != first
    with pytest.raises(WeightsLoadError, match="does not exist"):
        hash_weights_path(str(tmp_path / "missing"))


async def test_a_path_load_and_a_peer_stream_of_the_same_files_give_one_hash_and_digest(tmp_path: Path) -> None:
    """Files that sort one way by path parts and another by relative path (``a.b`` before ``a/b``
    as strings, after it as parts): the load reads them in the order a peer sends them."""
    root = tmp_path / "ckpt"
    (root / "a").mkdir(parents=True)
    (root / "a" / "b").write_bytes(b"one" * 1000)
    (root / "a.b").write_bytes(b"two" * 1000)
    content_hash, digest = read_weights_path(str(root))
    assert digest == digest_files(root)
    loaded = SimWeights(version="v", content_hash=content_hash, source=str(root), digest=digest, loaded=True)
    sent = sim_stream.export(loaded)
    header = WeightsStreamHeader(version="v", digest=digest, backend="sim", nbytes=sent.nbytes, tensors=sent.tensors)
    pieces = (bytes(p) async for p in sent.pieces)
    received = await sim_stream.receive(header, pieces, "v")
    assert (received.content_hash, received.digest) == (content_hash, digest)


def test_the_config_file_reads_camel_case_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text('{"backend": "sim", "role": "prefill", "port": 9000, "maxBatchSize": 4, "sim": {"speed": 2}}')
    config = build_config(load_config_file(path), role="decode", port=9100, sim_speed=0.0, host=None)
    assert (config.role.value, config.port, config.max_batch_size, config.sim.speed) == ("decode", 9100, 4, 0.0)
    assert config.resolved_advertise_url() == "http://127.0.0.1:9100"
    assert build_config({"backend": "sim"}, advertise_url="http://engine-0.drs:8000/").resolved_advertise_url() == (
        "http://engine-0.drs:8000"
    )


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"backend": "sim", "tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 1}, "moe"),
        ({"backend": "sim", "gpuMemoryUtilization": 1.5}, "gpuMemoryUtilization"),
        ({"backend": "sim", "maxBatchSise": 4}, "maxBatchSise"),
        ({"backend": "trtllm"}, "model"),
    ],
    ids=[
        "a-moe-split-that-does-not-multiply-to-tp",
        "memory-over-100-percent",
        "a-misspelt-key",
        "trtllm-without-a-model",
    ],
)
def test_invalid_configs_are_refused(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        build_config(data)
