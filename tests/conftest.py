"""The ``slow`` marker on the parametrized cases that run 4 processes and on the largest of the rest, and how
the tests share 2 processes.

A test that always starts 4 gloo processes or a subprocess carries ``@pytest.mark.slow`` itself; a test
parametrized over worlds gets it only for its 4-process cases: those whose ``world`` (or ``*_world``)
parameter is 4. ``pytest -m "not slow"`` runs the rest (docs/testing.md).

``pytest -n 2`` (pytest-xdist) runs the tests on two workers, each with its own gloo pools
(tests/helpers/distributed.py). A worker is handed a whole test file at a time, so a file's module-scoped
fixtures (a Megatron-LM run, a trained folder) run once and the Megatron files' pools close after the file
(tests/megatron/conftest.py); the tests of a file in ``SPLIT`` share nothing and go one by one to whichever
worker is free. The files (or tests of ``SPLIT``) holding slow tests are handed out first, in collection
order, the longest known ones (``LONGEST``) before them: the long ones start early and the short ones fill
in at the end, so no worker idles while the other finishes a three-minute test.
"""

from __future__ import annotations

import pytest

# files whose tests are independent of each other (no module-scoped fixture worth sharing, nothing left for the
# next test): under xdist their tests go one by one to whichever worker is free
SPLIT = {"tests/docs/test_doc_blocks.py", "tests/engine/test_torch_tools.py", "tests/app/test_plan_doc.py",
         "tests/app/test_stuck_rank.py"}
# the units that take longest (a minute or more each on 2 cores; docs/testing.md, "How long it takes"), started
# first in this order: under -n 2 the other worker goes through the rest meanwhile, and no worker is left with a
# long one at the end (a prefix of a unit's node id)
LONGEST = (
    "tests/megatron/test_megatron_lm_recipes.py",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/pipeline.md]",
    "tests/app/test_plan_doc.py::test_a_worked_example_prints_what_the_doc_shows",
    "tests/megatron/test_megatron_swiglu_checkpoint.py",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/megatron.md]",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/cli.md]",
)

# the largest of the other tests (over about 2 s each on an idle 2-core machine; `--durations` of the quick tier,
# docs/testing.md "How long it takes"): marked ``slow`` too, so that ``-m "not slow"`` answers in under 3 minutes.
# They run in the default run (and CI) as every other test; a node id prefix each.
LARGEST_OF_THE_REST = (
    "tests/app/test_bench_muon.py::test_muon_beside_adamw_shows_balanced_newton_schulz_work",
    "tests/app/test_pipeline_train.py::test_a_pipeline_trains_as_one_process",  # these four share a 20 s fixture
    "tests/app/test_pipeline_train.py::test_a_pp2_checkpoint_",
    "tests/app/test_pipeline_train.py::test_a_checkpoint_of_two_stages_per_rank",
    "tests/test_layering.py::test_the_app_entry_points_load_on_first_use",
    "tests/test_layering.py::test_scan_sees_relative_lazy_and_submodule_imports",
    "tests/models/test_meta_build_cost.py::test_meta_build_imports_no_dynamo",
    "tests/megatron/test_megatron_options.py::test_ignored_rows_wrap_and_change_nothing",
    "tests/megatron/test_megatron_options.py::test_fp32_main_weights_with_bf16_main_grads_train_like_one_process",
    "tests/megatron/test_megatron_options.py::test_manual_buffer_registration_exists_and_says_what_to_do",
    "tests/megatron/test_megatron_lm_checkpoint.py::test_state_dict_keys_are_megatron_adapters_for_every_strategy",
    "tests/megatron/test_megatron_lm_checkpoint.py::test_fsdp_dtensor_checkpoint_loads_at_another_data_parallel_size",
    "tests/megatron/test_megatron_swiglu_checkpoint.py",
    "tests/megatron/test_megatron_nccl_ub.py::test_nccl_ub_and_fine_grained_gathers_train_bit_for_bit_on_gloo",
    "tests/megatron/test_megatron_cuda_graph_mode.py::test_graph_mode_keeps_addresses_syncs_nothing_and_trains_as_eager",
    "tests/megatron/test_megatron_dist_index.py::test_every_parameter_carries_megatron_fsdps_checkpoint_attributes",
    "tests/app/test_fp8_train.py::test_fp8_pipeline_stages_train_as_one_fp8_process",
    "tests/app/test_fp8_train.py::test_fp8_run_exports_plain_weights",
    "tests/engine/test_muon_owner.py::test_torch_muon_matches_one_process",
    "tests/engine/test_muon_checkpoint.py::test_checkpoint_moves_across_world_sizes_fsdp2_and_plain",
    "tests/hf/test_hf_export.py::test_presets_export_to_transformers",
    "tests/hf/test_hf_train.py::test_hf_config_trains_and_exports",
    "tests/engine/test_torch_tools.py::test_plain_dcp_reshards_4_to_2_to_1",  # 4 processes
    "tests/engine/test_torch_tools.py::test_dtensors_and_state_dict_api",
    "tests/clients/test_torchtitan.py::test_torchtitan_tp_2x2_matches_fsdp2",  # 4 processes
    "tests/clients/test_torchtitan.py::test_torchtitan_hsdp_2x2_matches_fsdp2",  # 4 processes
    "tests/models/test_pipeline_split.py::test_stage_gradients_equal_the_whole_models_including_the_moe_aux_loss",
    "tests/engine/test_readme_example.py::test_the_readme_engine_example_trains_as_written",
    "tests/benchmarks/test_cpu_adam.py::test_cpu_adam_bench_tiny",
    "tests/checkpoint/test_checkpoint.py::test_reshard_matrix",
    "tests/checkpoint/test_checkpoint.py::test_rank_killed_mid_save_leaves_previous_checkpoint_loadable",
    "tests/engine/test_graph_safe.py::test_cast_grads_accumulate_once_per_micro_batch_in_graph_safe_mode",
    "tests/app/test_plan.py::test_the_trace_agrees_with_the_reference_estimate",
    "tests/app/test_plan_dry_run.py",
    "tests/app/test_bench.py::test_the_fp32_main_ceiling_runs_beside_the_bf16_one",
    "tests/app/test_bench.py::test_tiny_benchmark_on_two_processes",
    "tests/app/test_bench.py::test_every_wrapper_clips_when_asked",
    "tests/app/test_bench.py::test_gradients_can_travel_in_bf16",
    "tests/models/test_tp_ep.py::test_tp2_gpt_matches_tp1",
    "tests/engine/test_fp8.py::test_fp8_units_compile_once_without_graph_breaks_and_train_like_eager",
    "tests/engine/test_fsdp2_tp_dtensor_params.py::test_tp_dtensor_params_train_and_checkpoint_as_fsdp2",
    "tests/engine/test_fsdp2_reduce_dtype_division.py::test_hsdp_16bit_reduce_divides",
)


@pytest.fixture(autouse=True, scope="module")
def _pools_without_left_over_groups():
    """After each test file, a gloo pool whose workers hold many left-over process groups is replaced
    (``tests/helpers/distributed.close_crowded_pools``): their idle threads would slow every later test."""
    yield
    from tests.helpers.distributed import close_crowded_pools

    close_crowded_pools()


def _four_processes(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any((name == "world" or name.endswith("_world")) and value == 4 for name, value in params.items())


def _unit(nodeid: str) -> str:
    """What an xdist worker is handed as a whole: the test's file, or the test itself for a file of ``SPLIT``."""
    file = nodeid.split("::", 1)[0]
    return nodeid if file in SPLIT else file


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _four_processes(item) or item.nodeid.startswith(LARGEST_OF_THE_REST):
            item.add_marker(pytest.mark.slow)
    slow = {_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def order(item) -> tuple[int, bool]:
        unit = _unit(item.nodeid)
        longest = next((i for i, prefix in enumerate(LONGEST) if unit.startswith(prefix)), len(LONGEST))
        return longest, unit not in slow

    items.sort(key=order)  # stable: each file's own order kept


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without pytest-xdist, never called
def pytest_xdist_make_scheduler(config, log):
    # xdist's loadgroup would do this with xdist_group marks, but it renames items through Item._nodeid, which
    # pytest 9.2's nodes no longer read: a scheduler of our own, xdist's loadscope with ``_unit`` as the scope
    from xdist.scheduler import LoadScopeScheduling

    class _ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection order above (xdist's: largest file first)
    return _ByUnit(config, log)


# the doc-runner's report (tests/docs/test_doc_blocks.py: per page, the blocks run and those skipped, with why),
# sent as each page's user property: under xdist the pages run in the workers, and this list is the main process's
_DOC_RUNNER: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _DOC_RUNNER.extend(value for name, value in report.user_properties if name == "doc-runner")


def pytest_terminal_summary(terminalreporter):
    if _DOC_RUNNER:
        terminalreporter.section("doc-runner: code blocks of README.md and docs/")
        for line in sorted(_DOC_RUNNER):  # page order, whichever worker ran which page first
            terminalreporter.write_line(line)
