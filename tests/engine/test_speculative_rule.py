"""The speculation cost rule (``cbrun.engine.spec_decode.speculative``): how many tokens a request proposes, decided without timing."""

import itertools

import pytest

from cbrun.engine import EngineConfig, SamplingParams
from cbrun.engine.core.request import Request
from cbrun.engine.spec_decode.speculative import VERIFY_ENTRY_ROWS, Speculator, proposal_length, verify_threshold


def test_verify_threshold_is_the_plain_steps_tokens_per_unit_of_cost_times_a_rows_cost():
    assert verify_threshold(0.0, 128, 128) == 0.0  # rows cost nothing: any proposal pays
    assert verify_threshold(0.03, 1, 1) == pytest.approx(0.03 / 1.03)
    assert verify_threshold(0.03, 8, 8) == pytest.approx(0.24 / 1.24)
    assert verify_threshold(0.03, 128, 128) == pytest.approx(3.84 / 4.84)
    assert verify_threshold(0.03, 40, 8) == pytest.approx(0.24 / 2.2)  # prefill rows dilute the fixed cost


@pytest.mark.parametrize(
    "acceptance, threshold, k, expected",
    [
        (1.0, 0.5, 4, 4),  # always accepted: all k
        (1.0, 0.9, 4, 0),  # always accepted, yet 4 tokens do not pay for 4 rows and the entry at 0.9 each
        (0.5, 0.2, 4, 2),  # 0.5 and 0.25 clear 0.2, 0.125 does not
        (0.5, 0.2, 1, 1),  # capped by k (or by the room left)
        (0.9, 0.6, 8, 4),  # 0.9 ** 4 = 0.656, 0.9 ** 5 = 0.59
        (0.2, 0.2, 4, 0),  # not above the threshold: plain decoding
        (0.0, 0.0, 4, 0),  # never accepted
        (0.3, 0.0, 4, 4),  # free rows
        (0.3, 0.2, 4, 0),  # its one row would pay (0.3 > 0.2), not with the verify entry's cost (0.3 < 2 * 0.2)
    ],
)
def test_proposal_length(acceptance, threshold, k, expected):
    assert proposal_length(acceptance, threshold, k) == expected


def test_without_an_entry_cost_each_proposal_needs_only_to_pay_its_row():
    assert proposal_length(0.3, 0.2, 4, entry_rows=0.0) == 1
    assert proposal_length(0.3, 0.2, 4) == 0


def test_the_rule_never_makes_a_step_slower_than_plain_decoding_under_its_cost_model():
    """For every batch size, row cost and mix of acceptance rates, the step the rule plans yields at least the
    tokens per unit of cost of the plain step (expected tokens under the geometric acceptance model; each verify
    entry costs its proposals' rows plus ``VERIFY_ENTRY_ROWS``)."""
    rates = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99)
    for row_cost, batch, k in itertools.product((0.003, 0.03, 0.3), (1, 2, 8, 32, 128), (1, 4, 8)):
        threshold = verify_threshold(row_cost, batch, batch)
        plain = batch / (1 + row_cost * batch)
        for mix in itertools.combinations_with_replacement(rates, 3):
            alphas = [mix[i % 3] for i in range(batch)]
            lengths = [proposal_length(a, threshold, k) for a in alphas]
            tokens = batch + sum(sum(a**i for i in range(1, j + 1)) for a, j in zip(alphas, lengths))
            cost = 1 + row_cost * (batch + sum(lengths) + VERIFY_ENTRY_ROWS * sum(1 for j in lengths if j))
            assert tokens / cost >= plain * (1 - 1e-12), (row_cost, batch, k, mix)
            # ...and it speculates where a row clearly pays: a near-certain proposal pays its row and the entry.
            if max(alphas) >= 0.9 and 0.9 > (1 + VERIFY_ENTRY_ROWS) * threshold:
                assert max(lengths) > 0, (row_cost, batch, k, mix)


def _repeating_request(sampling_params: SamplingParams | None = None) -> Request:
    """A request whose tokens repeat "1 2 3 4", so n-gram lookup always proposes the next ones."""
    return Request("r", [1, 2, 3, 4] * 4, sampling_params or SamplingParams(max_new_tokens=1000))


def _speculator(**config) -> Speculator:
    return Speculator(
        EngineConfig(
            speculative="ngram",
            ngram_min=1,
            ngram_max=2,
            num_speculative_tokens=4,
            speculative_max_batch=256,
            speculative_row_cost=0.03,
            **config,
        )
    )


def _step(speculator: Speculator, request: Request, num_running: int, num_accepted: int) -> int:
    """Plan one step at ``num_running`` requests; the target accepts ``num_accepted`` proposals (then a bonus)."""
    speculator.active(num_running)
    proposals = speculator.propose(request, 1000)
    if proposals:
        accepted = proposals[:num_accepted]
        speculator.record(request, len(proposals), len(accepted))
        request.output_token_ids.extend(
            accepted + [proposals[len(accepted)] if len(accepted) < len(proposals) else 1 + (proposals[-1] % 4)]
        )
    else:
        request.output_token_ids.append(1 + (request.output_token_ids[-1] % 4) if request.output_token_ids else 1)
    return len(proposals)


def test_a_request_whose_proposals_are_rejected_backs_off_and_probes_again():
    speculator, request = _speculator(), _repeating_request()
    lengths = [_step(speculator, request, 8, num_accepted=0) for _ in range(60)]
    # First the full k (no evidence yet), then fewer, then none; a probe of one proposal now and then (about every
    # 14 steps at 8 running requests: one proposal must pay for its row and for the verify entry).
    assert lengths[0] == 4 and lengths[1] < 4
    backed_off = lengths[5:]
    assert max(backed_off) == 1 and 3 <= sum(backed_off) <= 5
    # Once its proposals are accepted again, it climbs back to the full k.
    after = [_step(speculator, request, 8, num_accepted=4) for _ in range(40)]
    assert 4 in after[:15] and after[15:] == [4] * 25
    assert speculator.num_verify_steps == sum(1 for n in lengths + after if n)
    assert speculator.num_proposed_tokens == sum(lengths + after)


def test_a_bigger_batch_asks_for_a_higher_acceptance_rate():
    """Half of each request's proposals accepted: worth it alone, not with 128 requests sharing a step."""
    lengths = {}
    for num_running in (1, 8, 128):
        speculator, request = _speculator(), _repeating_request()
        lengths[num_running] = [_step(speculator, request, num_running, num_accepted=1) for _ in range(30)][10:]
    assert min(lengths[1]) >= 3
    assert 1 <= min(lengths[8]) and max(lengths[8]) <= 2
    assert max(lengths[128]) <= 1 and lengths[128].count(0) > 10


def test_evidence_is_kept_per_match_length():
    """Rejected proposals after bigram matches back the request off those, not its first unigram match."""
    speculator, request = _speculator(), _repeating_request()
    lengths = [_step(speculator, request, 8, num_accepted=0) for _ in range(12)]  # "... 3 4" always matches 2 tokens
    assert lengths[0] == 4 and max(lengths[6:]) <= 1
    request.output_token_ids += [9, 2]  # "9 2" is new; "2" alone occurred before: a unigram match, fresh evidence
    proposals = speculator.propose(request, 1000)
    assert len(proposals) == 4 and proposals[:2] == [3, 4]  # the full k: no evidence on unigram matches yet


def test_row_cost_zero_always_proposes_k():
    speculator, request = _speculator(), _repeating_request()
    speculator.row_cost = 0.0
    assert [_step(speculator, request, 128, num_accepted=0) for _ in range(10)] == [4] * 10


def test_a_sampled_rows_proposals_do_not_depend_on_its_batch():
    """Its draws depend on its proposals, so their number reads only its own evidence (seeded rows reproducible)."""
    params = SamplingParams(max_new_tokens=1000, temperature=0.8, seed=3)
    runs = []
    for num_running in (1, 8, 128):
        speculator, request = _speculator(), _repeating_request(params)
        runs.append([_step(speculator, request, num_running, num_accepted=i % 3) for i in range(30)])
    assert runs[0] == runs[1] == runs[2] and sum(runs[0]) > 30


def test_ngram_index_equals_a_rescan_of_the_whole_sequence():
    """The incremental index proposes what a scan for the latest earlier occurrence of the suffix proposes."""
    import random

    from cbrun.engine.spec_decode.speculative import NgramIndex

    def rescan(tokens, low, high, k):
        if k <= 0 or len(tokens) <= low:
            return []
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            for end in range(len(tokens) - 1, n - 1, -1):
                if tokens[end - n : end] == tokens[len(tokens) - n :]:
                    return tokens[end : end + k]
        return []

    rng = random.Random(0)
    for _ in range(100):
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        index, tokens = NgramIndex(low, high), []
        for _ in range(40):
            new = [rng.randint(0, 4) for _ in range(rng.randint(0, 4))]
            tokens += new
            index.extend(new)
            k = rng.randint(0, 5)
            assert index.propose(k) == rescan(tokens, low, high, k), (low, high, tokens, k)
            end, n = index.lookup()
            assert n == 0 or (tokens[end - n : end] == tokens[len(tokens) - n :] and end < len(tokens))
            assert (n == 0) == (rescan(tokens, low, high, 1) == [])
