"""The sampler: mii::sample_race (C++, CPU) draws the same tokens as the torch path (`sample_torch`) for the same
seeds, steps and parameters; and what both draw follows the distribution: temperature, top-k, top-p and min-p keep
exactly the tokens they should, in their odds."""
import pytest
import torch

from mii import kernels
from mii.engine.sampler import (SamplingBatch, _penalties_dense, apply_penalties, exponential_noise, sample,
                                sample_torch, token_logprobs)

pytestmark = pytest.mark.skipif(kernels.load_cpu_kernels() is not None,
                                reason=f"CPU kernels not built: {kernels.load_cpu_kernels()}")


def _batch(S, V, temperature=1.0, top_p=1.0, top_k=None, min_p=0.0, seeds=None, steps=None):
    full = lambda v, dtype=torch.float32: torch.full((S,), v, dtype=dtype)  # noqa: E731
    top_k = V if top_k is None else top_k
    return SamplingBatch(greedy=torch.zeros(S, dtype=torch.bool), temperature=full(temperature), top_p=full(top_p),
                         top_k=full(top_k, torch.long), min_p=full(min_p),
                         seeds=torch.arange(S) if seeds is None else seeds,
                         steps=torch.zeros(S, dtype=torch.long) if steps is None else steps,
                         all_greedy=False, needs_sort=top_p < 1 or top_k < V, any_min_p=min_p > 0)


def _race(logits, sb):
    return torch.ops.mii.sample_race(logits, sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.seeds, sb.steps)


@pytest.mark.parametrize("temperature,top_p,top_k,min_p", [
    (1.0, 1.0, None, 0.0), (0.7, 1.0, None, 0.0), (1.3, 0.9, None, 0.0), (1.0, 1.0, 50, 0.0),
    (0.8, 0.95, 40, 0.05), (1.0, 1.0, None, 0.1), (0.01, 1.0, None, 0.0), (2.0, 0.5, 3000, 0.0)])
def test_kernel_draws_what_the_torch_path_draws(temperature, top_p, top_k, min_p):
    g = torch.Generator().manual_seed(7)
    S, V = 300, 5000
    logits = torch.randn(S, V, generator=g) * torch.rand(S, 1, generator=g) * 8  # flat to peaked rows
    logits[:, 11] = float("-inf")  # a masked token (a ban, a constraint)
    logits[0, :] = float("-inf")
    logits[0, 123] = 0.0  # a row where one token is allowed
    seeds = torch.randint(-2 ** 62, 2 ** 62, (S,), generator=g)  # negative seeds too
    steps = torch.randint(0, 5000, (S,), generator=g)
    sb = _batch(S, V, temperature, top_p, top_k, min_p, seeds, steps)
    ours, ref = _race(logits, sb), sample_torch(logits, sb)
    assert ours[0] == 123 and not (ours == 11).any()
    differ = (ours != ref).nonzero().flatten()
    # only an exact near-tie of the race may round differently: the kernel's token scores as high as the torch one
    scores = torch.softmax(logits / temperature, -1) / exponential_noise(seeds, steps, V)
    for r in differ.tolist():
        assert scores[r, ours[r]] >= scores[r, ref[r]] * (1 - 1e-5), (r, ours[r], ref[r])
    assert len(differ) <= 1


def _frequencies(logits_row, n, **kw):
    V = logits_row.shape[0]
    sb = _batch(n, V, seeds=torch.arange(n) * 7919 + 3, **kw)
    tokens = _race(logits_row.expand(n, V).contiguous(), sb)
    return torch.bincount(tokens, minlength=V).double() / n


def _within(freq, probs, n):
    sigma = torch.sqrt(probs * (1 - probs) / n)
    assert ((freq - probs).abs() <= 5 * sigma + 1e-9).all(), (freq, probs)


def test_temperature_follows_the_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, -9.0, float("-inf")])
    n = 20000
    for t in (0.5, 1.0, 1.7):
        _within(_frequencies(logits, n, temperature=t), torch.softmax(logits.double() / t, 0), n)


def test_top_k_top_p_min_p_keep_exactly_their_tokens():
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    p = logits.double().exp()
    n = 20000
    renorm = lambda keep: torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()  # noqa: E731
    # top_p 0.75: 0.4 + 0.25 = 0.65 < 0.75 keeps the third token; then 0.8 >= 0.75 drops the rest
    _within(_frequencies(logits, n, top_p=0.75), renorm(torch.arange(6) < 3), n)
    _within(_frequencies(logits, n, top_k=2), renorm(torch.arange(6) < 2), n)
    # min_p 0.3: tokens under 0.3 x 0.4 = 0.12 go
    _within(_frequencies(logits, n, min_p=0.3), renorm(p >= 0.12), n)
    # top_p so small that only the first token stays
    assert (_frequencies(logits, 200, top_p=0.01)[0] == 1).all()


def test_sample_uses_the_kernel_and_keeps_greedy_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=g)
    sb = _batch(6, 300, temperature=1.0)
    sb.greedy = torch.tensor([True, False, True, False, False, True])
    out = sample(logits, sb).tokens
    race = _race(logits, sb)
    for r in range(6):
        assert out[r] == (logits[r].argmax().item() if sb.greedy[r] else race[r].item())
    # every row sampled (no argmax), from bf16 logits read as they are: what the race draws from their float values
    every = _batch(6, 300, temperature=1.0, top_p=0.9)
    every.any_greedy = False
    half = logits.bfloat16()
    assert sample(half, every).tokens == _race(half, every).tolist() == _race(half.float(), every).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("V", [1, 15, 16, 49152, 49157])
def test_argmax_rows_picks_what_torch_argmax_picks(dtype, V):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(7, V, generator=g) * 4).to(dtype)
    logits[1] = float("-inf")                                 # every token masked: index 0, as torch
    logits[2] = 1.0                                           # all tied: the first
    logits[3, V // 2:] = logits[3].max() + 1                  # tied maxima after the first half: the first of them
    logits[4, V - 1] = float("inf")                           # the last token, in the vector tail or not
    logits[5, V // 3] = float("nan")                          # a NaN counts as the largest, as in torch
    logits[5, V - 1] = float("nan")
    logits[6, 0] = logits[6].max() + 1                        # the first token
    ours = torch.ops.mii.argmax_rows(logits)
    assert ours.dtype == torch.long and ours.tolist() == logits.float().argmax(dim=-1).tolist()
    assert torch.ops.mii.argmax_rows(logits[:0]).shape == (0,)


def test_greedy_rows_of_bf16_logits_are_argmax_of_their_float_values():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 49152, generator=g).bfloat16()
    sb = _batch(5, 49152)
    sb.greedy, sb.all_greedy = torch.ones(5, dtype=torch.bool), True
    assert sample(logits, sb).tokens == logits.float().argmax(dim=-1).tolist()
    sb.logprobs = 0  # logprobs asked for: the fp32 path, the same tokens
    out = sample(logits, sb)
    assert out.tokens == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == pytest.approx(logits.float().log_softmax(-1).max(-1).values.tolist())


def test_seeded_draws_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 1000, generator=g)
    sb = _batch(5, 1000, temperature=0.9, top_p=0.9, seeds=torch.tensor([5, 6, 7, 8, 9]),
                steps=torch.tensor([0, 3, 3, 10, 2]))
    together = _race(logits, sb)
    for r in range(5):
        one = _batch(1, 1000, temperature=0.9, top_p=0.9, seeds=sb.seeds[r:r + 1], steps=sb.steps[r:r + 1])
        assert _race(logits[r:r + 1], one).item() == together[r].item()


def test_infinite_and_nan_logits_stay_inside_the_rows():
    """+inf logits win, NaN ones are masked, and the top-p / top-k bins stay inside their arrays (a NaN bin index
    wrote outside them and killed the process, from a repetition penalty near 0)."""
    inf, nan = float("inf"), float("nan")
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, 7] = inf
    logits[1, [3, 900]] = inf
    logits[2, :] = nan
    logits[2, 5] = 1.0
    logits[3, 11], logits[3, 12] = inf, nan
    for top_p, top_k in ((1.0, None), (0.9, None), (1.0, 50), (1e-30, 3)):
        sb = _batch(4, 1000, top_p=top_p, top_k=top_k)
        tokens = _race(logits, sb).tolist()
        assert tokens[0] == 7 and tokens[1] in (3, 900) and tokens[2] == 5 and tokens[3] == 11, (top_p, top_k)
        assert sample_torch(logits, sb).tolist() == tokens


def test_a_repetition_penalty_near_zero_keeps_logits_finite():
    """(5e-324 > 0 passes validation, and is 0 in float32: a positive logit of a seen token divided by it.)"""
    logits = torch.tensor([[2.0, -1.0, 0.0, 3.0]])
    pen = (torch.tensor([5e-324]), torch.zeros(1), torch.zeros(1), torch.tensor([[0, 1, 2]]), torch.tensor([[-1]]))
    out = apply_penalties(logits, pen)
    assert torch.isfinite(out).all() and out[0, 0] == torch.finfo(torch.float32).max
    assert out[0, 1] == 0 and out[0, 2] == 0 and out[0, 3] == 3.0  # (negative ones are multiplied: -0)


def test_penalties_on_the_tokens_that_occur_equal_the_dense_ones():
    """The CPU's penalties on the ids that occur (mii::penalize_) give every logit bit for bit what the dense [S, V]
    form (the GPU's) gives: repeated ids, ids in both the prompt and the output, -1 padding, rows with no ids."""
    g = torch.Generator().manual_seed(3)
    S, V = 6, 500
    logits = torch.randn(S, V, generator=g) * 4
    prompt = torch.randint(0, 40, (S, 30), generator=g)  # a small range: many repeats, shared with the output
    output = torch.randint(0, 40, (S, 25), generator=g)
    prompt[1, 10:] = -1
    output[2, 5:] = -1
    prompt[3], output[3] = -1, -1
    pen = (torch.tensor([1.3, 0.7, 1.0, 2.0, 1e-40, 1.1]), torch.tensor([0.5, -1.0, 2.0, 0.0, 0.3, -2.0]),
           torch.tensor([0.25, 1.5, -0.5, 1.0, 0.0, 2.0]), prompt, output)
    dense = _penalties_dense(logits, pen)
    assert torch.equal(apply_penalties(logits, pen), dense)
    assert not torch.equal(dense, logits)
    mine = logits.clone()
    assert apply_penalties(mine, pen, in_place=True) is mine and torch.equal(mine, dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_rows_are_log_softmax_and_its_top_k(dtype, k):
    """mii::logprobs_rows against torch's log_softmax and topk: the target's logprob and the top k's values equal
    within float rounding, the ids hold those values, descending, ties (many in bf16) with the lower id first."""
    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(7, 3001, generator=g) * 4).to(dtype)
    targets = torch.tensor([0, 3000, 17, 5, 5, 2999, 1234])
    chosen, top, ids = torch.ops.mii.logprobs_rows(logits, targets, k)
    lp = logits.float().log_softmax(-1)
    torch.testing.assert_close(chosen, lp.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=5e-6)
    assert top.shape == ids.shape == (7, k)
    torch.testing.assert_close(top, lp.topk(k, -1).values, rtol=0, atol=5e-6)
    torch.testing.assert_close(lp.gather(1, ids), top, rtol=0, atol=5e-6)
    for row_v, row_i in zip(top.tolist(), ids.tolist()):
        assert len(set(row_i)) == k
        for j in range(1, k):
            assert row_v[j - 1] > row_v[j] or (row_v[j - 1] == row_v[j] and row_i[j - 1] < row_i[j])
    # the sampler's and the prompt scorer's entry point takes the same path
    assert torch.equal(token_logprobs(logits, targets, k)[2], ids)
