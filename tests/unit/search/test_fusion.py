"""Score fusion and hybrid request bodies: pure functions, no OpenSearch needed."""

import math

import pytest
from cagflow.search.fusion import min_max_fusion, min_max_normalize, reciprocal_rank_fusion
from cagflow.search.queries import (filter_clauses, hybrid_query, knn_query, normalization_pipeline, pipeline_name,
                                    rrf_pipeline)


def test_min_max_normalize_scales_to_unit_interval():
    assert min_max_normalize({"a": 10.0, "b": 5.0, "c": 0.0}) == {"a": 1.0, "b": 0.5, "c": 0.0}


def test_min_max_normalize_equal_scores_become_one():
    assert min_max_normalize({"a": 3.2, "b": 3.2}) == {"a": 1.0, "b": 1.0}
    assert min_max_normalize({}) == {}


def test_min_max_fusion_is_weighted_mean_with_missing_hits_as_zero():
    bm25 = {"a": 12.0, "b": 6.0, "c": 0.0}
    knn = {"b": 0.9, "d": 0.5}
    fused = dict(min_max_fusion([bm25, knn], weights=[0.25, 0.75]))
    assert fused["a"] == pytest.approx(0.25)
    assert fused["b"] == pytest.approx((0.25 * 0.5 + 0.75 * 1.0))
    assert fused["c"] == pytest.approx(0.0)
    assert fused["d"] == pytest.approx(0.0)


def test_min_max_fusion_orders_best_first_and_breaks_ties_by_id():
    fused = min_max_fusion([{"x": 1.0, "y": 1.0, "z": 0.0}], weights=[1.0])
    assert [key for key, _ in fused] == ["x", "y", "z"]


def test_min_max_fusion_weights_are_relative():
    lists = [{"a": 2.0, "b": 1.0}, {"a": 0.1, "b": 0.3}]
    assert dict(min_max_fusion(lists, [1, 3])) == pytest.approx(dict(min_max_fusion(lists, [0.25, 0.75])))


@pytest.mark.parametrize("weights", [[1.0], [0.0, 0.0], [-1.0, 2.0]])
def test_min_max_fusion_rejects_bad_weights(weights):
    with pytest.raises(ValueError):
        min_max_fusion([{"a": 1.0}, {"a": 1.0}], weights)


def test_reciprocal_rank_fusion_sums_reciprocal_ranks():
    fused = dict(reciprocal_rank_fusion([["a", "b", "c"], ["c", "b"]], rank_constant=60))
    assert fused["a"] == pytest.approx(1 / 61)
    assert fused["b"] == pytest.approx(2 / 62)
    assert fused["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert [key for key, _ in reciprocal_rank_fusion([["a", "b", "c"], ["c", "b"]])] == ["c", "b", "a"]


def test_reciprocal_rank_fusion_ignores_raw_scores_scale():
    """Only ranks matter: a hit first in both lists gets 2 / (k + 1) whatever the engines scored."""
    (top, score), *_ = reciprocal_rank_fusion([["a", "b"], ["a"]], rank_constant=1)
    assert top == "a" and math.isclose(score, 1.0)


def test_reciprocal_rank_fusion_rejects_non_positive_constant():
    with pytest.raises(ValueError):
        reciprocal_rank_fusion([["a"]], rank_constant=0)


def test_filters_reach_both_hybrid_sub_queries():
    filters = filter_clauses(tier="fixed", doc_id="handbook")
    bm25, knn = hybrid_query("annual leave", [0.1] * 384, depth=20, filters=filters)["hybrid"]["queries"]
    assert bm25["bool"]["filter"] == filters
    assert knn["knn"]["embedding"]["filter"] == {"bool": {"filter": filters}}
    assert knn["knn"]["embedding"]["k"] == 20


def test_knn_query_without_filters_has_no_filter_clause():
    assert "filter" not in knn_query([0.0] * 384, 5, [])["knn"]["embedding"]


def test_unknown_tier_is_rejected():
    with pytest.raises(ValueError):
        filter_clauses(tier="archived")


def test_pipeline_names_follow_their_content():
    assert pipeline_name(normalization_pipeline([0.3, 0.7])) == pipeline_name(normalization_pipeline([0.3, 0.7]))
    assert pipeline_name(normalization_pipeline([0.3, 0.7])) != pipeline_name(normalization_pipeline([0.5, 0.5]))
    assert pipeline_name(rrf_pipeline(60)) != pipeline_name(rrf_pipeline(10))
