"""Recipe records (oal.conversion.recipe): a record re-stored with another exact KV dtype names the recipe that
gives exactly its fields."""

from dataclasses import asdict

from oal.conversion.recipe import RECIPES, with_exact_kv_dtype


def test_restored_record_names_the_matching_recipe():
    record = {**asdict(RECIPES["retrieval"]), "beta_offset_applied": -5.0}
    record["score_lengths"] = list(record["score_lengths"])  # as JSON gives it back
    int8 = with_exact_kv_dtype(record, "int8")
    assert int8["name"] == "retrieval-int8kv" and int8["exact_kv_dtype"] == "int8"
    assert int8["beta_offset_applied"] == -5.0
    assert with_exact_kv_dtype(int8, "bfloat16")["name"] == "retrieval"
    odd = with_exact_kv_dtype(record, None)  # bf16 products without bf16 keys: no recipe gives it
    assert odd["name"] == "retrieval+exact_kv_dtype=None" and odd["exact_kv_dtype"] is None


def test_records_without_the_decode_budget_fields_are_full_decode():
    """A record written before the decode budget existed (no exact_decode_* fields) is the recipe without one; given
    the default budget it is the default recipe again."""
    from oal.conversion.recipe import BUDGET, with_recipe_fields

    legacy = {k: v for k, v in asdict(RECIPES["retrieval"]).items() if not k.startswith("exact_decode")}
    assert with_recipe_fields(legacy)["name"] == "retrieval-fulldecode"
    budgeted = with_recipe_fields(legacy, exact_decode_budget=BUDGET, exact_decode_page=64)
    assert budgeted["name"] == "retrieval" and budgeted["exact_decode_budget"] == BUDGET
    odd = with_recipe_fields(legacy, exact_decode_budget=512, exact_decode_page=64)
    assert odd["name"] == "retrieval+exact_decode_budget=512"
