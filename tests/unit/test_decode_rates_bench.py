"""``bench/decode_rates.round_figures``: a round's decode rates from its streams' chunk timings,
on made-up timings (the GPU benchmark's arithmetic, checked without a GPU)."""

from __future__ import annotations

import pytest

from bench.decode_rates import Stream, round_figures, span_at_pace


def stream(sent: float, first: float, per_s: float, tokens: int) -> Stream:
    """A stream sent at ``sent`` whose first token arrives at ``first`` and then one token every
    ``1 / per_s`` seconds, ``tokens`` in all."""
    chunks = [(first + i / per_s, 1) for i in range(tokens)]
    return Stream(sent, chunks[0][0], chunks[-1][0], tokens, chunks)


def test_streams_that_all_start_together_run_together_for_their_whole_span() -> None:
    runs = [stream(0.0, 0.1, 100.0, 101) for _ in range(4)]
    got = round_figures(runs)
    assert got.aggregate == pytest.approx(400.0)
    assert got.per_stream == pytest.approx(100.0)
    assert got.ttft == pytest.approx(0.1)
    # the window starts at the first token, which it does not count (like the aggregate's "after each first")
    assert got.all_running == pytest.approx(400.0)
    assert got.all_running_s == pytest.approx(1.0)


def test_short_streams_spread_over_a_long_arrival_have_no_moment_all_running() -> None:
    """The case the figure exists for: 1 s streams arriving over 2 s never all run at once, and
    the whole span's rate (here 2 streams x 100 tokens over 3 s) reflects the arrival window."""
    runs = [stream(0.0, 0.0, 100.0, 101), stream(2.0, 2.0, 100.0, 101)]
    got = round_figures(runs)
    assert got.aggregate == pytest.approx(200 / 3.0)
    assert got.all_running is None and got.all_running_s is None


def test_the_all_running_window_counts_only_the_tokens_inside_it() -> None:
    """Stream b starts 1 s late; from then until a's end (2 s) both run: 100 + 100 tokens a second."""
    a, b = stream(0.0, 0.0, 100.0, 201), stream(1.0, 1.0, 100.0, 201)
    got = round_figures([a, b])
    assert got.all_running_s == pytest.approx(1.0)
    # a's tokens in (1, 2]: 100; b's in (1, 2]: 100 (its first, at 1.0, is outside)
    assert got.all_running == pytest.approx(200.0)
    assert got.aggregate == pytest.approx(400 / 3.0)


def test_the_sends_spread_is_the_first_to_the_last_send() -> None:
    runs = [stream(0.25, 0.3, 100.0, 11), stream(1.75, 1.8, 100.0, 11), stream(1.0, 1.1, 100.0, 11)]
    assert round_figures(runs).sent_spread_s == pytest.approx(1.5)


def test_the_span_at_pace_is_what_streams_at_a_fixed_rate_from_their_sends_read() -> None:
    """Streams at exactly ``per_s`` from the moment they are sent read that figure as their
    aggregate, and a stream that starts late (a TTFT) reads below it."""
    sends = [0.0, 0.5, 1.2, 2.0]
    at_rate = [stream(t, t, 100.0, 201) for t in sends]
    at_pace = span_at_pace(len(sends), 201, sent_spread_s=2.0, per_stream_tok_s=100.0)
    # 4 x 200 tokens over 2 s of sends + 2 s of one stream's decode
    assert at_pace == pytest.approx(200.0)
    assert round_figures(at_rate).aggregate == pytest.approx(at_pace)
    late = [stream(t, t + 0.1, 100.0, 201) for t in sends[:-1]] + [stream(2.0, 2.3, 100.0, 201)]
    assert round_figures(late).aggregate < at_pace
    # longer streams over the same sends approach the per-stream rate times the streams
    assert span_at_pace(4, 20_001, 2.0, 100.0) == pytest.approx(400.0, rel=0.01)
