"""Shared fixtures: a small prepared corpus and tiny configs that train in milliseconds per step."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from scale_llm.config import load_config
from scale_llm.data.prepare import prepare
from scale_llm.log import setup_logging
from tests.helpers import SINGLE, TINY_MODEL, Lines, Runs, env, finished_run, logged

setup_logging(0)


def pytest_configure(config):
    # Tests never touch the network; Hugging Face libraries read these when first imported,
    # and nothing imports them before this hook runs.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


# DeepSpeed on the CPU JIT-compiles two C++ ops the first time a process needs them (its shared-
# memory all-reduce at every `init_distributed`, and CPUAdam for offload): ~3 min of compiling on
# 2 cores, cached in TORCH_EXTENSIONS_DIR (~/.cache/torch_extensions). Cold, the first DeepSpeed
# world of a session stalls on it; built in the background at the lowest priority from the start,
# the compile uses the cores the single-process tests leave idle. A process that needs an op
# while it is being built waits on torch's lock file, so the build is never killed (a killed build
# leaves that lock behind): the test session waits for it at its end.
_DEEPSPEED_OPS = "from deepspeed.comm.torch import build_shm_op; build_shm_op(); "
_DEEPSPEED_OPS += "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
_prebuild: subprocess.Popen | None = None


# ----------------------------------------------------------------------------- test tiers
# `bash launch/test.sh --fast` runs what is not marked slow: the in-process tests and one
# multi-process parity case. Marked here, in one place: every test that reads torchrun runs (the
# `runs` fixture) but FAST_WORLD; by `pytest --durations` on 2 cores; and the tests of processes
# around training (launchers' signals, prepare's workers, import hygiene).
SLOW_MODULES = {"test_distributed.py", "test_reliability.py", "test_offload_census.py"}
FAST_WORLD = "test_distributed.py::test_backend_matches_single_process[ddp]"
# the slow tests that start DeepSpeed say so in their module's or their own name (not zero_bubble)
DEEPSPEED_TESTS = re.compile(r"zero[0-3]|deepspeed|every_backend|offload|7b", re.IGNORECASE)
SLOW_TESTS = {  # by module::function (every parameter): over ~4 s each on 2 cores, then the rest
    "test_eval_tasks.py::test_an_unknown_task_stops_every_rank_with_the_message",
    "test_memory_fake.py::test_fsdp2_x_tensor_parallel_at_4_fake_ranks_peaks_where_the_estimate_says",
    "test_tensor_parallel.py::test_tensor_parallel_alone_follows_one_process",
    "test_tensor_parallel.py::test_fsdp_x_tensor_parallel_resumes_at_another_degree",
    "test_mixture.py::test_weights_per_source_losses_and_exact_resume",
    "test_cli.py::test_a_wheel_installs_with_its_configs_and_runs_from_anywhere",
    "test_cli.py::test_generate_into_a_closed_pipe_or_an_ascii_terminal_ends_without_a_traceback",
    "test_cli.py::test_cli_user_errors_exit_2_without_traceback",
    "test_cli.py::test_launchers_run_a_checkout_with_a_python3_that_has_only_the_dependencies",
    "test_cli.py::test_launchers_use_the_active_python_then_the_venv_then_say_what_to_do",
    "test_cli.py::test_prepare_train_generate_on_the_builtin_corpus",
    "test_cli.py::test_deepspeed_sh_checks_that_a_cached_op_was_built_for_this_python",
    "test_cli.py::test_run_messages_count_this_launch_and_a_finished_run_is_left_alone",
    "test_cli.py::test_the_gpu_check_stops_when_torch_cannot_use_the_gpus_nvidia_smi_lists",
    "test_compile.py::test_a_missing_compiler_is_named_and_planted_cache_code_never_runs",
    "test_owned_files.py::test_the_gpu_checks_fp8_item_alone_refuses_a_scratch_folder_others_can_write",
    "test_owned_files.py::test_a_stop_signal_during_export_or_convert_leaves_nothing_half_written",
    "test_compile.py::test_compile_true_without_a_compiler_stops_the_launch_before_any_work",
    "test_compile.py::test_compiled_run_follows_the_eager_curve",
    "test_compile.py::test_no_graph_break_and_no_recompilation_while_training",
    "test_compile.py::test_compiled_resume_is_exact",
    "test_compile.py::test_bench_times_the_compiled_step_against_the_same_step_eager",
    "test_compile.py::test_ddp_runs_each_compiled_block_as_one_graph",
    "test_compile.py::test_the_gpu_check_runs_on_the_cpu_and_writes_its_report",
    "test_errors.py::test_a_leftover_world_size_says_what_it_waits_for_then_stops",
    "test_fp8.py::test_compiled_fp8_blocks_follow_eager_without_graph_breaks",
    "test_fp8.py::test_gpu_check_compares_fp8_with_bf16_in_its_report",
    "test_fp8.py::test_gpu_check_reads_its_settings_before_any_work",
    "test_fp8.py::test_an_fsdp2_checkpoint_gathering_fp8_weights_is_read_without_fp8",
    "test_fp8.py::test_a_checkpoint_of_torchaos_fp8_weight_class_is_named_in_one_paragraph",
    # (2-3 s each: the fast tier kept under 3 minutes)
    "test_roofline.py::test_a_ddp_run_states_its_all_reduce_on_the_link_its_ranks_span",
    "test_compile.py::test_the_gpu_checks_order_and_configs_on_a_stub_gpu",
    "test_pipeline.py::test_the_last_ranks_loss_forward_holds_the_gathered_logits_beside_its_own_part",
    "test_roofline.py::test_bench_roofline_prices_the_world_the_config_is_laid_out_for",
    "test_roofline.py::test_fsdp2_without_tensor_parallelism_prices_and_states_its_gathers_and_reduce_scatters",
    "test_security.py::test_a_folder_naming_its_own_code_is_refused_even_with_y_on_stdin",
    "test_eval_tasks.py::test_fsdp_world_scores_the_whole_model_as_scale_llm_eval_does",
    "test_eval_tasks.py::test_tasks_run_at_their_steps_and_leave_the_loss_curve_alone",
    "test_hf.py::test_two_rank_runs_import_and_export_the_same_weights",
    "test_memory.py::test_a_measured_step_has_the_estimated_parts_and_peak",
    "test_memory.py::test_compiled_blocks_save_no_more_than_the_estimate",
    "test_memory.py::test_estimate_command_json_and_fit",
    "test_memory.py::test_estimate_measure_prints_the_step_next_to_the_estimate",
    "test_memory.py::test_every_backend_at_two_ranks_peaks_where_the_estimate_says",
    "test_memory.py::test_every_pipeline_rank_peaks_where_its_estimate_says",
    "test_pipeline.py::test_torchs_runtime_keeps_at_most_three_of_a_ranks_stages_unsharded",
    "test_pipeline.py::test_a_v_schedules_last_stage_keeps_the_heads_output_gradient_between_its_halves",
    "test_roofline.py::test_the_doc_states_the_70b_layouts_the_code_makes_and_the_yamls_are_the_best",
    "test_roofline.py::test_every_published_run_falls_inside_its_predicted_range",
    "test_memory.py::test_predicted_activations_match_counted_bytes",
    "test_memory.py::test_prediction_at_400m_dimensions",
    "test_memory.py::test_tensor_parallel_at_two_ranks_peaks_where_the_estimate_says",
    "test_memory_fake.py::test_125m_traced_on_fake_tensors_has_the_estimated_parts",
    "test_model.py::test_past_seq_len_the_cache_starts_over_from_the_newest_half",
    "test_owned_files.py::test_the_run_lock_admits_one_of_many_simultaneous_launches",
    "test_train.py::test_a_cpu_run_keeps_the_memory_it_frees",
    "test_train.py::test_bench_reference_runs_the_same_model_on_the_same_batch",
    "test_train.py::test_bench_runs_the_training_step_on_synthetic_tokens",
    "test_train.py::test_each_bench_compiles_for_its_own_static_shapes",
    "test_train.py::test_every_launch_logs_its_first_and_the_last_step",
    "test_train.py::test_loss_falls_on_real_text",
    "test_train.py::test_metrics_rows_and_tensorboard_events",
    "test_train.py::test_resume_continues_the_same_loss_curve",
    "test_train.py::test_tensorboard_never_shows_a_step_twice",
    "test_train.py::test_the_gpt2_reference_is_a_flop_matched_gpt2_and_learns",
    "test_train.py::test_what_users_watch_tensorboard_wandb_samples_and_progress",
    "test_roofline.py::test_the_doc_states_the_calibration_table_the_code_makes",
    "test_roofline.py::test_the_shipped_configs_state_the_prediction_the_code_makes",
    "test_suite.py::test_the_fast_tier_starts_no_deepspeed_build",
    "test_suite.py::test_listing_the_tests_starts_no_deepspeed_build",
    "test_roofline.py::test_the_shipped_pipeline_configs_state_the_prediction_the_code_makes",
    "test_compile.py::test_compiled_blocks_compose_with_every_checkpointing_mode",
    "test_security.py::test_a_module_in_the_working_folder_is_never_imported",
    "test_fp8.py::test_fp8_follows_the_bf16_curve",
    "test_fp8.py::test_tensor_parallel_gathers_fp8_activations_on_gpus",
    "test_fp8.py::test_fsdp2_fp8_gather_precomputes_the_scales_after_each_step",
    "test_pipeline.py::test_a_stages_gathered_blocks_follow_its_forwards_and_backwards",
    "test_pipeline.py::test_a_v_schedule_with_checkpointing_peaks_where_its_estimate_says",
    "test_pipeline.py::test_an_fp32_v_schedule_counts_the_gradient_each_backward_makes",
    "test_pipeline.py::test_a_v_schedule_keeps_each_input_halfs_gradient_and_what_its_stages_pass",
    "test_pipeline.py::test_a_v_schedules_first_stage_keeps_its_embeddings_16_bit_gradient",
    "test_pipeline.py::test_every_k_under_a_pipeline_checkpoints_a_ranks_blocks_as_applied",
    "test_pipeline.py::test_the_last_stage_keeps_its_logits_through_its_blocks_backward",
    "test_memory_fake.py::test_a_pipeline_ranks_trace_keeps_its_sends_as_torchs_works_do",
    "test_memory_fake.py::test_a_pipeline_x_tensor_parallel_rank_peaks_where_its_estimate_says",
    "test_memory.py::test_human_report_ends_with_hints",
    # processes around training
    "test_cli.py::test_torchrun_ends_with_2_when_every_worker_refused_its_input",
    "test_eval_tasks.py::test_a_task_folders_private_copy_goes_with_a_process_that_skips_its_teardown",
    "test_config.py::test_a_ds_accelerator_deepspeed_does_not_know_is_named_by_the_preflight",
    "test_compile.py::test_a_launch_past_its_time_is_stopped_with_sigterm_first",
    "test_cli.py::test_a_stop_signal_to_the_torchrun_launchers_ends_with_the_checkpoint",
    "test_prepare_scale.py::test_prepare_workers_die_with_a_killed_parent",
    "test_prepare_scale.py::test_sigterm_during_prepare_says_what_was_kept",
    "test_prepare_scale.py::test_a_script_calling_prepare_without_a_main_guard_stops_instead_of_waiting",
    "test_owned_files.py::test_two_prepares_of_one_data_dir_take_turns",
    "test_fp8.py::test_torchao_imports_quietly_off_a_gpu",
    "test_fp8.py::test_runs_without_fp8_never_import_torchao",
}


# `launch/test.sh` runs two pytest-xdist workers (`--dist loadfile`), each given a test file at a
# time; files that read the same session runs go together (built once per worker otherwise:
# test_reliability's DCP moves start from test_distributed's 2-rank runs).
SAME_WORKER = {"test_reliability.py": "test_distributed.py"}


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: pytest without xdist runs too)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # (xdist's own)
    from xdist.scheduler import LoadFileScheduling

    class SharedRunsTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            folder, _, name = file.rpartition("/")
            return f"{folder}/{SAME_WORKER.get(name, name)}"

    return SharedRunsTogether(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        module, _, name = item.nodeid.rpartition("/")[2].partition("::")
        if item.nodeid.endswith(FAST_WORLD):
            continue
        listed = module in SLOW_MODULES or f"{module}::{name.partition('[')[0]}" in SLOW_TESTS
        if listed or "runs" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


def pytest_collection_finish(session):
    global _prebuild
    if session.config.option.collectonly:  # listing tests builds nothing and waits on nothing
        return
    # Only the slow tier starts DeepSpeed (its worlds and the offload census); a fast test that
    # merely names it (a config's `zero_stage`) needs no op, and the fast tier never waits on one
    slow = [item.nodeid for item in session.items if item.get_closest_marker("slow")]
    if any(DEEPSPEED_TESTS.search(nodeid) for nodeid in slow):
        for lock in stale_extension_locks():
            lock.unlink(missing_ok=True)
            print(f"\nconftest: removed {lock}: a build killed earlier left it", file=sys.stderr)
        _prebuild = subprocess.Popen(
            [sys.executable, "-c", _DEEPSPEED_OPS],
            env=env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(19),
        )


def stale_extension_locks(root: Path | None = None) -> list[Path]:
    """torch's op-build lock files (`<root>/<python>_<device>/<op>/lock`) that no process holds.

    A build creates its lock and keeps it open until it removes it; a build that was killed
    leaves it behind, and every later process that needs the op waits on it forever. On Linux
    the holders are visible in /proc; where a process running as a lock's owner cannot be read
    (or on another OS) nothing is called stale."""
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    locks = sorted(root.glob("*/*/lock")) + sorted(root.glob("*/lock"))
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    owners = {lock.stat().st_uid for lock in locks}  # (a build creates its lock as its user)
    held = set()
    for fds in Path("/proc").glob("[0-9]*/fd"):
        try:
            names = os.listdir(fds)
        except PermissionError:  # unreadable: if it runs as a lock's owner, it might hold it
            try:
                if fds.parent.stat().st_uid in owners:
                    return []
            except OSError:
                pass
            continue
        except OSError:  # gone meanwhile
            continue
        for name in names:
            try:
                held.add(os.readlink(fds / name))
            except OSError:
                continue
    return [lock for lock in locks if str(lock.resolve()) not in held]


def pytest_sessionfinish(session):
    if _prebuild is None:
        return
    try:
        _prebuild.wait(timeout=1200)  # a cold build takes ~3 min on 2 cores
    except subprocess.TimeoutExpired:  # waiting on a lock a killed build left: do not hang
        _prebuild.kill()
        print(
            "\nconftest: DeepSpeed's op build did not finish in 20 min; a build killed earlier "
            "may have left a lock file under ~/.cache/torch_extensions (delete it)",
            file=sys.stderr,
        )


@pytest.fixture
def logs() -> Iterator[Lines]:
    """The scale_llm logger's records during the test, INFO and above (`tests.helpers.logged`:
    a handler of its own, not pytest's `caplog`, whose reach differs between pytest versions)."""
    logger = logging.getLogger("scale_llm")
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with logged() as lines:
            yield lines
    finally:
        logger.setLevel(level)


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 1.5 MB of the standard library's .py files, copied into a local corpus directory."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for f in sorted(root.glob("*.py"))[:80]:
        shutil.copyfile(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    cfg = load_config(
        None,
        [
            *TINY_MODEL,
            f"data.source={corpus_dir}",
            f"data.dir={out}",
            "data.tokenizer_sample_bytes=500000",
            "data.val_fraction=0.1",
        ],
    )
    prepare(cfg)
    return out


@pytest.fixture(scope="session")
def four_steps(data_dir, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (read only: tests copy it)."""
    root = tmp_path_factory.mktemp("four_steps")
    return finished_run(data_dir, root, "checkpoint.every=2", "checkpoint.keep_last=2")


@pytest.fixture(scope="session")
def exported(four_steps, tmp_path_factory) -> Path:
    """four_steps' step 4 exported as a Hugging Face folder (fp32)."""
    pytest.importorskip("safetensors")
    from scale_llm.export import export

    out = tmp_path_factory.mktemp("exported") / "hf"
    export(four_steps / "checkpoints" / "step_00000004", out, dtype="fp32")
    return out


@pytest.fixture(scope="session")
def runs(data_dir, tmp_path_factory) -> Runs:
    """The test session's torchrun training runs of the tiny model (`tests.helpers.Runs`): a run
    that several modules read (the one-process reference, a backend's 2-rank run) starts once."""
    return Runs(data_dir, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="session")
def reference(runs) -> dict[int, dict]:
    """One process, 8 sequences per step, straight through: the curve each layout of the same 8
    sequences follows. Clipping is really exercised: max norm 0.3 is below steps 1 and 2's."""
    rows = runs("single", 1, *SINGLE)
    assert all(rows[s]["grad_norm"] > 0.3 for s in (1, 2))
    return rows


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


LAUNCH_VARIABLES = (
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@pytest.fixture(autouse=True)
def _launch_environment():
    """A run in the test's process sets the launch variables it lacks (as torchrun would have,
    components/distributed.py) and the communication settings (its flight recorder's files in
    its run dir); a later in-process command would read them as its launch (an estimate
    'launched with 1 processes'), and a later launch's ranks as the user's own (their traces in
    the earlier run's dir). Each test ends with the environment it began with, and with the
    console's log handler it began with (one a test bound to a stream it closed fails later
    tests' lines)."""
    from scale_llm.components.distributed import COMM_ENV, TRACE_FILE

    before = {k: os.environ.get(k) for k in (*LAUNCH_VARIABLES, *COMM_ENV, TRACE_FILE)}
    console = logging.getLogger("scale_llm")
    handlers, level = console.handlers[:], console.level
    yield
    console.handlers[:] = handlers
    console.setLevel(level)
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
