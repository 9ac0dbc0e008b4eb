"""The calls mlx-lm 0.32.2's server runs a llama prompt's prefill in, as the seam reports them
(POST /hetero/tokenize: "calls"), and a test-only recorder of the calls the model really gets.

Where the decoder cuts a prompt matters wherever its arithmetic depends on the cut: `dynamic`
rope recomputes its base per call past max_position_embeddings, and a sliding layer's buffer at
T - 1 holds the last call's rows (docs/findings/mlx-lm-server-llama-schedule.md). Read from
`server.py` and `generate.py` of the pinned release, for one request at a time:

- batch path (a chat or completion without "seed", on a server without --kv-bits or a draft
  model): the server cuts the prompt cache's C tokens off the front of its segments (system,
  user, assistant: ResponseGenerator._tokenize), BatchGenerator.insert_segments drops empty ones
  and splits the last token off into a segment of its own, and each segment is prefilled in calls
  of min(left, prefill_step_size) from its own start; the last token is the first decode call.
- single path (generate_step): from C, calls of min(prefill_step_size, left - 1), then the last
  token alone.

A prediction for the cache as it is when asked: a mount or another request in between changes
C. Several requests prefilled together are padded into common calls: not covered.
"""

import threading
from typing import Any, List, Sequence, Tuple


def decoder_calls(
    segments: Sequence[int], cached: int, step: int, batched: bool
) -> List[Tuple[int, int]]:
    """(first position, tokens) of each call that prefills a prompt whose segments have these
    lengths, C = cached of it already held, ending with the last token's call."""
    total = sum(segments)
    if not 0 <= cached < total:
        raise ValueError(f"{cached} cached tokens of a {total}-token prompt leave nothing to run")
    if step < 1:
        raise ValueError(f"prefill step {step} < 1")
    calls, pos = [], cached
    if not batched:
        left = total - cached
        while left > 1:
            n = min(step, left - 1)
            calls.append((pos, n))
            pos, left = pos + n, left - n
        return calls + [(pos, 1)]
    lengths, skip = list(segments), cached
    while skip > 0:  # server.py: the segments the cache covers dropped, the next one cut
        if skip >= lengths[0]:
            skip -= lengths.pop(0)
        else:
            lengths[0] -= skip
            skip = 0
    lengths = [n for n in lengths if n > 0]
    if lengths[-1] != 1:  # insert_segments: the last token a segment of its own
        lengths[-1] -= 1
        lengths.append(1)
    for n in lengths[:-1]:
        while n > 0:
            k = min(n, step)
            calls.append((pos, k))
            pos, n = pos + k, n - k
    return calls + [(pos, 1)]


class CallRecorder:
    """The token count of every call the decoder's model gets, in order (serve --test-faults:
    POST /hetero/calls reads and clears it). It observes only: the model's class is replaced by a
    subclass whose __call__ notes the input's length and calls the original."""

    def __init__(self, model: Any):
        self._lock = threading.Lock()
        self._calls: List[int] = []
        recorder, base = self, type(model)

        class Recorded(base):  # type: ignore[misc, valid-type]
            def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                with recorder._lock:
                    recorder._calls.append(int(inputs.shape[-1]))
                return base.__call__(self, inputs, *args, **kwargs)

        Recorded.__name__ = base.__name__
        Recorded.__qualname__ = base.__qualname__
        model.__class__ = Recorded

    def take(self) -> List[int]:
        with self._lock:
            calls, self._calls = self._calls, []
        return calls
