"""A step's outputs held until the next step's layers go into C (engine/batched/held.py): what is held, what is
posted at once, and the order, on outputs shaped as the library's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ttft_sse.engine.batched.held import Held


@dataclass
class Output:
    """The parts of the library's GenerationOutput that held.py reads."""

    request_id: str
    generated_tokens: list[int] = field(default_factory=lambda: [1, 2])
    finished: bool = False
    error: str | None = None

    def is_finished(self) -> bool:
        return self.finished


def held_and_posted() -> tuple[Held, list[list[str]]]:
    posted: list[list[str]] = []
    return Held(lambda outputs: posted.append([o.request_id for o in outputs])), posted


def test_a_steps_outputs_wait_for_the_next_steps_layers_to_go_into_c_and_come_first_then() -> None:
    held, posted = held_and_posted()
    held.release()  # step 1's layers in C
    held.deliver([Output("a"), Output("b")])
    assert posted == []
    held.release()  # step 2's layers: step 1's outputs go now, before step 2 ends
    assert posted == [["a", "b"]]
    held.deliver([Output("a", [1, 2, 3])])
    held.release()
    held.release()  # a second call in the same step (the next layer) has nothing left
    assert posted == [["a", "b"], ["a"]]


def test_a_first_token_a_last_one_or_an_error_goes_at_once_with_what_was_held_before_it() -> None:
    for urgent in (Output("new", [7]), Output("done", finished=True), Output("bad", error="boom")):
        held, posted = held_and_posted()
        held.release()
        held.deliver([Output("a")])
        held.release()  # posts a
        held.deliver([Output("b")])  # held
        assert posted == [["a"]]
        held.release()
        held.deliver([Output("c"), urgent])
        assert posted == [["a"], ["b"], ["c", urgent.request_id]], urgent


def test_a_step_whose_layers_did_not_go_into_c_posts_at_once_and_what_was_held_first() -> None:
    held, posted = held_and_posted()
    held.deliver([Output("a")])  # no release in this step: a model whose layers are not in C
    assert posted == [["a"]]
    held.release()
    held.deliver([Output("b")])  # held
    held.deliver([Output("c")])  # a step without release (a path without the C layers): b then c, at once
    assert posted == [["a"], ["b", "c"]]
