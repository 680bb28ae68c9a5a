"""PT_HPU_RECIPE_CACHE_CONFIG (Intel's on-disk recipe cache): parsed and checked, a bad value
names the variable and the expected format."""

from __future__ import annotations

import pytest

from vllm_gaudi_platform import envs

VAR = "PT_HPU_RECIPE_CACHE_CONFIG"


def test_unset_or_empty_recipe_cache_is_none():
    assert envs.recipe_cache({}) is None
    assert envs.recipe_cache({VAR: " "}) is None


def test_recipe_cache_reads_directory_delete_flag_and_size():
    cache = envs.recipe_cache({VAR: "/data/recipes, True ,8192"})
    assert cache == envs.RecipeCache("/data/recipes", True, 8192)


def test_recipe_cache_accepts_intels_trailing_boolean_field():
    assert envs.recipe_cache({VAR: "/c,false,40960,false"}) == envs.RecipeCache("/c", False, 40960)


@pytest.mark.parametrize(
    "value, problem",
    [
        ("/data/recipes", "is not valid"),
        (",false,10", "is not valid"),
        ("/c,maybe,10", "delete flag must be true or false"),
        ("/c,false,big", "max size must be a positive number"),
        ("/c,false,0", "max size must be a positive number"),
    ],
)
def test_bad_recipe_cache_value_names_the_variable_and_the_format(value, problem):
    with pytest.raises(envs.EnvError, match=problem) as info:
        envs.recipe_cache({VAR: value})
    assert VAR in str(info.value) and "<directory>,<true|false>,<max size in MB>" in str(info.value)
