"""Suite-wide settings for the parallel run the README gives (`pytest -n 2`, pytest-xdist, a whole file per worker:
pytest.ini's --dist loadfile, so a module's shared fixture, such as one trained run checked by several tests, is built
once).

- Each worker gets its share of the cores, for its own torch and every process it starts (OMP_NUM_THREADS): two
  workers at torch's default of one thread per core would run four compute threads on two cores, and OpenMP threads
  that lose their core spin instead of working.
- The workers take files in collection order, a worker taking the next once at most two tests of its own are left.
  The files of a minute or more (FIRST) go first, longest first, so that none is left for last to run alone while
  the other worker idles; in FIRST, those that start a Ray cluster alternate with those that do not, so the two
  workers do not start their clusters at the same moment (on a loaded machine Ray's 30 s wait for its raylet then
  ran out).
- End-to-end tests carry the `e2e` marker (E2E below), so that `pytest -m "not e2e"` is a quick loop over the unit-level
  truths. End to end: a test that trains (`rlm train`, the fit loop on real ranks), starts Ray or an SGLang server
  (real or the loopback stand-in), or runs a multi-process job (rank processes, a subprocess CLI run) of more than a few
  seconds. A test that shares a module-scoped fixture of its file with an e2e test is e2e too: the fixture would
  run for it anyway. Nothing can slip in unmarked unnoticed: an unmarked test that starts Ray or a training
  subprocess fails (_guarded, _guard_popen), and every run lists the unmarked tests slower than UNIT_LIMIT_S.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

FIRST = (  # longest first (benchmarks/RESULTS.md, "The suite's time"); Ray-starting files marked
    "tests/launch/test_local_cluster.py",  # Ray (a cluster of three nodes) and Slurm: about 4 minutes
    "tests/benchmarks/test_gpu_harness.py",
    "tests/driver/test_train.py",  # Ray
    "tests/driver/test_family_fit.py",
    "tests/driver/test_rank_restart.py",  # Ray, in its second run
    "tests/models/test_conversion.py",
    "tests/driver/test_elastic_pool.py",
    "tests/driver/test_moe_fit.py",
    "tests/transport/test_worker_group.py",  # Ray
    "tests/driver/test_async_train.py",
    "tests/driver/test_sigkill.py",  # Ray
    "tests/agent/test_tool_lookup.py",
    "tests/runtime/test_parallel_parity.py",
    "tests/rank/roles/test_actor.py",
    "tests/driver/test_vision_quickstart.py",  # rank processes; about 2 minutes on 2 loaded cores
    "tests/rollout/test_sglang_conformance.py",
    "tests/test_user_errors.py",
    "tests/rollout/test_sglang.py",
    "tests/driver/test_lora_fit.py",
    "tests/driver/test_delta_sync.py",
    "tests/models/test_lora.py",
    "tests/entry/test_convert_command.py",
    "tests/driver/test_distillation.py",
    "tests/driver/test_gsm8k_smoke.py",
    "tests/driver/test_full_disk.py",
)
REPO_ROOT = Path(__file__).resolve().parents[1]

# The e2e tests: a whole file (None), or the tests of a file named by function (all their parameters).
E2E: dict[str, tuple[str, ...] | None] = {
    "tests/agent/test_tool_lookup.py": None,
    "tests/agent/test_engines.py": ("test_sglang_serves_every_trajectory_turn_by_turn_token_ids_in_and_out_many_in_flight",),
    "tests/agent/test_tools.py": ("test_the_python_tool_contains_a_loop_a_fork_bomb_a_memory_hog_a_huge_print_and_the_network",),
    "tests/benchmarks/test_gpu_harness.py": ("test_cpu_rehearsal_runs_every_default_part",
                                             "test_cpu_rehearsal_runs_the_async_part"),
    "tests/checkpoint/test_integrity.py": ("test_a_load_that_fails_midway_names_the_file_on_every_rank",),
    "tests/config/test_transformer_config.py": None,
    "tests/driver/test_algorithms_fit.py": None,
    "tests/driver/test_async_train.py": None,
    "tests/driver/test_delta_sync.py": None,
    "tests/driver/test_distillation.py": ("test_the_quickstart_model_distilled_from_a_solved_run_reaches_0_8_in_"
                                          "fewer_steps_than_grpo",),
    "tests/driver/test_elastic_pool.py": None,
    "tests/driver/test_engine_fleet.py": (
        "test_a_colocated_server_spans_two_nodes_gets_each_ranks_buckets_and_restarts_whole",
        "test_a_disaggregated_server_spans_two_nodes_and_restarts_every_node",
        "test_a_spec_built_engine_sends_buckets_of_the_spec_size_and_joins_the_routers_it_names",
        "test_a_push_pauses_the_servers_and_continues_them"),
    "tests/driver/test_family_fit.py": None,
    "tests/driver/test_faults.py": ("test_a_killed_rank_stops_the_run_naming_the_step_and_the_last_complete_checkpoint",),
    "tests/driver/test_full_disk.py": None,
    "tests/driver/test_gsm8k_smoke.py": None,
    "tests/driver/test_lora_fit.py": None,
    "tests/driver/test_moe_fit.py": None,
    "tests/driver/test_rank_restart.py": None,
    "tests/driver/test_reward_model_fit.py": None,
    "tests/driver/test_role_settings.py": ("test_a_rank_built_from_the_spec_offloads_the_parts_each_role_asks_for",),
    "tests/driver/test_rollout_trace.py": None,
    "tests/driver/test_run_dir.py": None,
    "tests/driver/test_sigkill.py": ("test_nothing_the_driver_started_outlives_its_sigkill",),
    "tests/driver/test_train.py": None,
    "tests/driver/test_train_from_hf.py": None,
    "tests/driver/test_verl_command.py": None,
    "tests/driver/test_vision_quickstart.py": None,
    "tests/launch/test_local_cluster.py": None,
    "tests/launch/test_submit.py": ("test_slurm_dry_run_prints_the_whole_script_and_the_sbatch_command",
                                    "test_ray_dry_run_prints_the_job_submit_command",
                                    "test_a_ray_job_keeps_its_run_directory_outside_the_copy_ray_unpacks"),
    "tests/models/test_fp8.py": ("test_fp8_checkpoint_reads_as_its_dequantised_values_and_writes_back_bitwise",
                                 "test_rlm_convert_round_trips_an_fp8_checkpoint_byte_for_byte_at_tp2_pp2_through_bf16"),
    "tests/models/test_conversion.py": ("test_every_layout_matches_hf_and_round_trips_bitwise",),
    "tests/models/test_mxfp4.py": (
        "test_every_megatron_weight_read_from_mxfp4_equals_the_one_read_from_its_dequantised_reference",
        "test_rlm_convert_round_trips_an_mxfp4_checkpoint_byte_for_byte_at_tp2_ep2_through_bf16"),
    "tests/models/test_lora.py": None,
    "tests/models/test_gated_delta_net.py": None,
    "tests/models/test_hybrid_micro_batches.py": None,
    "tests/models/test_recompute.py": None,
    "tests/models/test_qwen2_5_vl.py": ("test_log_probs_on_images_equal_transformers_and_the_round_trip_is_bitwise",
                                        "test_a_frozen_tower_keeps_its_weights_through_an_update_and_a_trained_one_moves",
                                        "test_a_frozen_towers_weights_are_not_resent_after_the_first_sync"),
    "tests/models/test_qwen3_vl.py": (
        "test_log_probs_on_images_equal_transformers_and_the_export_generates_as_the_original",
        "test_a_frozen_towers_weights_are_not_resent_after_the_first_sync"),
    "tests/models/test_mtp_training.py": None,
    "tests/models/test_routing_replay.py": None,
    "tests/models/test_shared_prompts.py": None,
    "tests/models/test_vl_actor_batching.py": None,
    "tests/rank/roles/test_actor.py": None,
    "tests/rank/roles/test_critic_and_moe.py": None,
    "tests/rank/roles/test_divergence.py": ("test_every_rank_stops_after_an_optimizer_step_that_left_nan_in_one_ranks_weights",),
    "tests/rank/roles/test_optimizer.py": None,
    "tests/rank/test_lora_rank.py": None,
    "tests/rank/test_policy_rank.py": ("test_reference_and_critic_at_their_own_layouts_equal_the_actor_layout_run",),
    "tests/rank/test_teacher_rank.py": None,
    "tests/rank/test_weight_push.py": ("test_each_node_pushes_to_its_share_of_the_servers_at_the_same_time_as_the_"
                                       "others", "test_a_sender_that_fails_fails_the_push_on_every_rank_in_one_line_"
                                       "instead_of_leaving_them_waiting",
                                       "test_two_ranks_of_one_node_that_draw_one_port_draw_again_and_both_push"),
    "tests/planner/test_step_time.py": ("test_leaving_each_run_out_predicts_every_run_but_deepseek_v3s_within_25_"
                                        "percent",
                                        "test_each_deepseek_v3_run_left_out_is_predicted_within_25_percent_by_what_"
                                        "every_other_run_gives"),
    "tests/resharding/test_export.py": ("test_stream_is_bitwise_the_source_checkpoint_at_every_layout",),
    "tests/resharding/test_sync_to_local_engine.py": None,
    "tests/supervision/test_lifeline.py": ("test_server_group_ends_when_its_launcher_is_killed",),
    "tests/rollout/test_local_server.py": ("test_generation_follows_the_pushed_weights",
                                           "test_fp8_weights_cross_gloo_as_bytes_and_the_server_samples_with_them_dequantised"),
    "tests/rollout/test_local_vision.py": ("test_greedy_generation_with_images_is_transformers_generate",),
    "tests/rollout/test_sglang.py": (
        "test_generate_schema_results_and_finish_reasons", "test_colocated_sync_round_trips_buckets_in_order",
        "test_paused_generation_holds_requests_until_continued",
        "test_partial_rollout_goes_on_from_the_paused_tokens_with_the_new_weights",
        "test_without_partial_rollout_a_push_waits_for_the_samples_in_flight_and_holds_new_ones",
        "test_a_dead_server_is_restarted_and_stale_until_the_caller_pushes_then_serves_every_sample",
        "test_a_sample_on_its_way_while_another_restarts_the_server_meets_the_old_one_never_the_unsynced_new_one",
        "test_a_push_that_ends_after_the_server_restarted_leaves_the_new_server_stale",
        "test_server_that_never_becomes_healthy_reports_its_log_tail",
        "test_distributed_update_broadcasts_in_announced_order",
        "test_a_server_that_dies_during_a_push_is_left_out_and_the_others_get_every_weight",
        "test_a_disaggregated_push_brings_each_tp_rank_the_whole_model_every_server_at_once_as_the_planner_prices",
        "test_servers_join_the_router_with_weights_and_leave_it_to_restart",
        "test_a_router_with_the_older_worker_api_is_joined_and_left",
        "test_a_lora_adapter_is_loaded_sampled_with_and_replaced_by_the_next",
        "test_a_sleeping_engine_whose_server_restarted_wakes_without_resuming_what_the_new_server_holds",
        "test_a_server_outside_the_supported_versions_is_refused_in_one_line"),
    "tests/rollout/test_sglang_conformance.py": None,
    "tests/rollout/test_sglang_fp8.py": None,
    "tests/rollout/test_sglang_names.py": None,
    "tests/rollout/test_sglang_speculative.py": None,
    "tests/rollout/test_speculative.py": ("test_a_count_up_run_drafts_with_the_trained_mtp_layer_and_samples_from_"
                                          "the_policy",),
    "tests/runtime/test_parallel_parity.py": None,
    "tests/entry/test_cli.py": ("test_train_with_a_reward_plugin_that_does_not_load_exits_2_with_one_line",),
    "tests/entry/test_convert_command.py": ("test_every_family_converts_through_the_commands_at_tp2_and_back_bitwise",),
    "tests/test_e2e_guard.py": ("test_a_warm_fork_runs_as_a_new_interpreter_would",),
    "tests/models/test_megatron_fusers.py": ("test_importing_megatron_after_rlmegatron_on_a_cpu_torch_leaves_dynamo_and_inductor_unimported",),
    "tests/test_user_errors.py": ("test_a_divergence_stops_the_run_with_exit_3_naming_the_step_and_the_metric",
                                  "test_rlm_train_refuses_a_missing_data_file_in_one_line_before_ray"),
    "tests/tracking/test_backends.py": ("test_every_backend_gets_the_same_metric_names_values_and_samples",
                                        "test_a_resumed_run_continues_its_wandb_and_tensorboard_runs"),
    "tests/tracking/test_curves.py": ("test_report_draws_a_running_runs_curves_from_its_store",),
    "tests/tracking/test_tracking.py": ("test_rollout_samples_go_to_mlflow_every_step_of_a_long_run",),
    "tests/transport/test_local_ranks.py": ("test_importing_rlmegatron_leaves_torch_cuda_untouched",
                                            "test_a_hung_rank_fails_within_the_timeout",
                                            "test_ctrl_c_while_the_fork_server_imports_prints_no_traceback_of_it",
                                            "test_a_crashed_rank_is_reported_with_its_exit_code"),
    "tests/transport/test_worker_group.py": None,
}
# A unit test (not e2e) takes less than this on 2 idle cores; a run lists the unmarked tests that took longer.
UNIT_LIMIT_S = 5.0


def pytest_configure(config: pytest.Config) -> None:
    # W&B runs write to their run directory and never reach the network (the wandb backend's tests read them back
    # from there); its caches and artifact staging go to a directory of this session, not the user's home.
    os.environ["WANDB_MODE"] = "offline"
    scratch = tempfile.mkdtemp(prefix="rlm-tests-wandb-")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        os.environ[name] = os.path.join(scratch, name.lower())
    _guard_popen()
    # Every fork server of this session also imports what a driver imports, so that the commands warm_runs forks from
    # it start with those imported (the preload counts for the call that starts the server, whichever comes first).
    from rlmegatron.transport import fork_server
    from tests.helpers.warm_runs import DRIVER_MODULES

    fork_server._PRELOAD.extend(DRIVER_MODULES)
    if missing := [path for path in (*FIRST, *E2E) if not (REPO_ROOT / path).is_file()]:
        raise pytest.UsageError(f"tests/conftest.py: FIRST or E2E names files that do not exist: {', '.join(missing)}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        # The worker's share, for its own torch and, through OMP_NUM_THREADS, for every process it starts: ranks
        # (transport.local_ranks.rank_threads), servers, commands.
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        torch.set_num_threads(share)
        _more_ranks_than_cores_one_job_at_a_time()


def _more_ranks_than_cores_one_job_at_a_time() -> None:
    """run_ranks jobs with more ranks than the machine has cores (the 4-rank matrices on 2 cores) run one at a time
    across the workers of this run: two at once put 8 gloo ranks on 2 cores, where a 4-rank matrix took 420 s instead of
    112 s and the other ran past its time limit (`.ci/run` at d87d96f, benchmarks/RESULTS.md). A job waits for the
    lock before its ranks start, so its own time limit counts from its start. Wrapped here, in each worker, before any
    test module binds the name."""
    import fcntl
    import functools

    from rlmegatron.transport import local_ranks

    run_ranks = local_ranks.run_ranks
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getppid()))  # the same in every worker of this run
    lock_path = Path(tempfile.gettempdir()) / f"rlm-tests-rank-jobs-{run_id}.lock"

    @functools.wraps(run_ranks)
    def one_at_a_time(fn, nprocs, *args, **kwargs):
        if nprocs <= (os.cpu_count() or 1):
            return run_ranks(fn, nprocs, *args, **kwargs)
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return run_ranks(fn, nprocs, *args, **kwargs)

    local_ranks.run_ranks = one_at_a_time


def _relative(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(REPO_ROOT).as_posix()


def _module_fixtures(item: pytest.Item) -> set[str]:
    """The module-scoped fixtures of item's own file that it requests (not autouse ones: those every test of the
    file gets, and none of them is heavy)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    autouse = set(item.session._fixturemanager._getautousenames(item))
    found = set()
    for name, definitions in info.name2fixturedefs.items():
        definition = definitions[-1]
        if (definition.scope == "module" and name not in autouse
                and getattr(definition.func, "__module__", None) == getattr(item.module, "__name__", "")):
            found.add(name)
    return found


@pytest.hookimpl(tryfirst=True)  # before -m selects by the marker this adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def position(item: pytest.Item) -> int:
        path = _relative(item)
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=position)  # stable: the other files keep their order

    named: dict[str, set[str]] = {}  # the functions E2E names, per file, as collected
    e2e_fixtures: dict[str, set[str]] = {}
    for item in items:
        path, function = _relative(item), getattr(item, "originalname", item.name)
        if path in E2E and (E2E[path] is None or function in E2E[path]):
            item.add_marker(pytest.mark.e2e)
            named.setdefault(path, set()).add(function)
            e2e_fixtures.setdefault(path, set()).update(_module_fixtures(item))
    for item in items:  # a test that shares an e2e test's module fixture would run that fixture in a quick loop
        if item.get_closest_marker("e2e") is None and _module_fixtures(item) & e2e_fixtures.get(_relative(item), set()):
            item.add_marker(pytest.mark.e2e)
    # A name in E2E that no collected test has (renamed, removed) would leave its test unmarked without a word. Only
    # files that were collected whole are checked: `pytest path::test` collects part of one.
    whole = {_relative(item) for item in items}
    stale = [f"{path}::{function}" for path, functions in E2E.items() if path in whole and functions
             for function in functions if function not in named.get(path, set())
             and not any(arg.startswith(path + "::") for arg in config.args)]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: E2E names tests that were not collected: {', '.join(stale)}")


# An unmarked test that starts Ray or a training run is an end-to-end test left out of E2E: it fails, saying so.
_UNIT: list[str] = []  # the node id of the unmarked test being set up or run, if any


def _training_command(args) -> str | None:
    """What an end-to-end command line starts, or None: `rlm train`, a test job module that trains, `ray start`."""
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    if len(argv) == 1:
        argv = argv[0].split()
    program = os.path.basename(argv[0]) if argv else ""
    if program == "ray" and "start" in argv:
        return "a Ray head (ray start)"
    if program == "rlm" and "train" in argv[1:]:
        return "rlm train"
    for flag, module in zip(argv, argv[1:]):
        if flag == "-m" and module in ("rlmegatron", "rlmegatron.entry.cli") and "train" in argv:
            return f"rlm train (python -m {module})"
        if flag == "-m" and module.startswith("tests."):
            source = REPO_ROOT / (module.replace(".", "/") + ".py")
            if source.is_file() and ("run_training" in (text := source.read_text()) or '"train"' in text):
                return f"a training job (python -m {module})"
    return None


def _refuse_in_a_unit_test(args) -> None:
    if _UNIT and (what := _training_command(args)):
        raise RuntimeError(f"{_UNIT[-1]} starts {what}: an end-to-end test, which tests/conftest.py's E2E must "
                           "name (then `pytest -m 'not e2e'` leaves it out)")


def _guard_popen() -> None:
    """Both ways the tests start a command: subprocess, and warm_runs' fork (the same commands, forked warm)."""
    import subprocess

    from tests.helpers import warm_runs

    original = subprocess.Popen.__init__

    def __init__(self, args, *rest, **kwargs):
        _refuse_in_a_unit_test(args)
        original(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = __init__
    warm_popen = warm_runs.popen

    def popen(cmd, **kwargs):
        _refuse_in_a_unit_test(cmd)
        return warm_popen(cmd, **kwargs)

    warm_runs.popen = popen


def _ray_started_by(nodeid: str, was_up: bool) -> None:
    ray = sys.modules.get("ray")
    if not was_up and ray is not None and getattr(ray, "is_initialized", lambda: False)():
        raise RuntimeError(f"{nodeid} started Ray: an end-to-end test, which tests/conftest.py's E2E must name")


def _ray_up() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guarded(item))


def _guarded(item: pytest.Item):
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    was_up = _ray_up()
    _UNIT.append(item.nodeid)
    try:
        result = yield
    finally:
        _UNIT.pop()
    _ray_started_by(item.nodeid, was_up)
    return result


_UNIT_SECONDS: dict[str, float] = {}  # unmarked test -> its setup, call and teardown, as reported


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "e2e" not in report.keywords:
        _UNIT_SECONDS[report.nodeid] = _UNIT_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    slow = sorted(((seconds, nodeid) for nodeid, seconds in _UNIT_SECONDS.items() if seconds > UNIT_LIMIT_S),
                  reverse=True)
    if slow:  # on a busy machine a unit test may cross the line: this names them, it fails nothing
        terminalreporter.section(f"unit tests (not e2e) slower than {UNIT_LIMIT_S:.0f} s: make them faster or name "
                                 "them in tests/conftest.py's E2E")
        for seconds, nodeid in slow:
            terminalreporter.write_line(f"{seconds:7.2f}s {nodeid}")
