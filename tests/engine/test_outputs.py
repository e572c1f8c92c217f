"""`mii.engine.outputs` without a model: engine outputs → stream chunks and final responses, and the joiner."""
from mii.engine.engine import RequestOutput
from mii.engine.outputs import OutputProcessor, ResponseJoiner
from mii.engine.params import GenerationParams
from mii.engine.requests import EngineRequest
from mii.response import FinishReason, Response

NONE, STOP, LENGTH = FinishReason.NONE, FinishReason.STOP, FinishReason.LENGTH


def test_chunks_prefix_logprobs_and_final_responses():
    reqs = [EngineRequest([1, 2], GenerationParams(logprobs=1), 10, prefix="P: "),
            EngineRequest([3], GenerationParams(), 10)]
    out = OutputProcessor(reqs)
    out.bind([7, 8])
    news = out.update([RequestOutput(7, "a", [11], False, NONE, 2, 1, [(11, -0.5, {11: -0.5})])])
    chunk = out.chunk(news)
    assert chunk[0].generated_text == "P: a" and chunk[0].logprobs == [
        {"token_id": 11, "logprob": -0.5, "top_logprobs": {11: -0.5}}]
    assert chunk[1] == Response("", 1, 0, NONE) and chunk[1].logprobs is None
    news = out.update([RequestOutput(7, "b", [12], True, STOP, 2, 2, [(12, -1.0, {12: -1.0})]),
                       RequestOutput(8, "x", [13], True, LENGTH, 1, 1)])
    assert out.finished and out.chunk(news)[0].generated_text == "b"
    final = out.responses()
    assert final == [Response("P: ab", 2, 2, "stop"), Response("x", 1, 1, "length")]
    assert final[0].token_ids == [11, 12] and len(final[0].logprobs) == 2 and final[1].logprobs is None


def test_joiner_appends_pieces_and_keeps_the_latest_counts():
    joined = ResponseJoiner()
    joined.add([Response("a", 3, 1, NONE, [1], None), Response("", 2, 0, NONE, [], [])])
    joined.add([Response("b", 3, 2, LENGTH, [2], None), Response("c", 2, 1, STOP, [5], [{"token_id": 5}])])
    assert joined.responses() == [Response("ab", 3, 2, "length"), Response("c", 2, 1, "stop")]
    assert joined.responses()[1].logprobs == [{"token_id": 5}]


def test_steps_held_together_make_one_piece_a_sequence():
    """A replica's sink may hand over several steps' outputs at once (a stream's interval, a unary call): each
    sequence's chunk joins its pieces in order, with the latest counts, and the final responses are the same."""
    def steps(out):
        out.bind([7, 8])
        return [RequestOutput(7, "a", [11], False, NONE, 2, 1, [(11, -0.5, {11: -0.5})],
                              prompt_logprobs=[(1, None, {}), (2, -2.0, {2: -2.0})]),
                RequestOutput(8, "x", [13], False, NONE, 1, 1),
                RequestOutput(7, "b", [12], False, NONE, 2, 2, [(12, -1.0, {12: -1.0})]),
                RequestOutput(8, "y", [14], True, LENGTH, 1, 2),
                RequestOutput(7, "c", [15], True, STOP, 2, 3, [(15, -0.25, {15: -0.25})])]

    def requests():
        return [EngineRequest([1, 2], GenerationParams(logprobs=1, prompt_logprobs=1), 10, prefix="P: "),
                EngineRequest([3], GenerationParams(), 10)]

    one_by_one, held = OutputProcessor(requests()), OutputProcessor(requests())
    chunks = [one_by_one.chunk(one_by_one.update([o])) for o in steps(one_by_one)]
    [a, x] = held.chunk(held.update(steps(held)))
    assert (a.generated_text, a.token_ids, a.generated_length, a.finish_reason) == ("P: abc", [11, 12, 15], 3, STOP)
    assert [e["token_id"] for e in a.logprobs] == [11, 12, 15] and len(a.prompt_logprobs) == 2
    assert (x.generated_text, x.token_ids, x.generated_length, x.finish_reason, x.logprobs) == (
        "xy", [13, 14], 2, LENGTH, None)
    assert "".join(c[0].generated_text for c in chunks) == a.generated_text
    assert held.responses() == one_by_one.responses() and held.finished
    assert [r.token_ids for r in held.responses()] == [[11, 12, 15], [13, 14]]
