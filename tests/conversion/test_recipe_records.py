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
