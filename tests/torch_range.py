"""What a torch release can break, and the tests that prove it: the ``torch_range`` set.

``make test-torch TORCH=X`` runs these (``-m torch_range``) under torch X, in its own
venv; ``.ci/run`` does so for the floor of pyproject.toml's range and the CUDA image's
2.11, within 5 minutes each on a 2-core machine (issue 44). Everything else is our own
logic, which the dev pin's full ``make test`` proves once.

Each entry names what it proves. A path is a whole file (in-process tests of torch's
APIs through ours, cheap); a ``path::name`` is one test of a tier that starts processes.
``tests/conftest.py`` marks them; ``tests/unit/test_suite_rules.py`` checks every entry
still names a collected test.
"""

from __future__ import annotations

TORCH_RANGE: dict[str, str] = {
    # DCP: save (its return values, the async writer, metadata), load, reshard
    "tests/unit/test_ckpt_async.py": "DCP async save, snapshots of DTensors, crash mid-save",
    "tests/unit/test_ckpt_failures.py": "DCP save and load failures, resume fallbacks",
    "tests/unit/test_ckpt_parallel_load.py": "DCP load through our parallel reader",
    "tests/unit/test_resume_toctou.py": (
        "resume: DCP's FileSystemReader reads through its fs (our hashed descriptors)"
    ),
    "tests/unit/test_ckpt_redteam.py": "DCP metadata never unpickled before its hash",
    "tests/unit/test_export_toctou.py": (
        "export: DCP metadata unpickled (its classes only) from hashed bytes, a verified copy"
    ),
    "tests/unit/test_ckpt_layer_record.py": "the layer record DCP's metadata carries",
    "tests/unit/test_runtime_checkpoint.py": "dcp.save return values, uploads, markers",
    "tests/dist/test_checkpoint.py::test_each_host_holds_its_ranks_files_and_the_manifest_lists_them": (  # noqa: E501
        "a 4-rank DCP save over two hosts: files per rank and the manifest"
    ),
    "tests/dist/test_checkpoint.py::test_the_manifest_records_what_each_file_holds": (
        "DCP's .metadata read back per file"
    ),
    "tests/dist/test_checkpoint.py::test_resume_under_a_mixed_tp_plan_continues_the_loss_curve": (
        "DCP reshard: pipeline cuts and TP degrees change between save and load"
    ),
    "tests/dist/test_checkpoint.py::test_zero1_saves_what_one_device_resumes_exactly": (
        "ZeRO-1 optimizer shards saved by DCP, loaded by one process"
    ),
    # DTensor TP, ZeRO collectives, process groups, pipelines: exactness against one process
    "tests/dist/test_runtime_exact.py::test_zero1_plan_matches_single_process[mixed-tp]": (
        "DTensor TP beside TP 1, ZeRO-1 reduce-scatter and all-gather, P2P between stages"
    ),
    "tests/dist/test_fsdp_exact.py::test_a_run_folder_run_trains_exactly": (
        "FSDP2 over gloo: SUM reduction (the default differs by release), padded shares"
    ),
    "tests/dist/test_fsdp_exact.py::"
    "test_weight_sharded_plan_matches_single_process[tp2-one-stage]": (
        "FSDP2 over the 'dp' dimension of a (holders x TP) mesh built from groups"
    ),
    "tests/dist/test_preempt.py::test_the_hosts_preemption_check_stops_training_at_a_saved_step": (  # noqa: E501
        "an emergency DCP save of FSDP2 shards on a host's notice, loaded by one process"
    ),
    "tests/unit/test_stage_recompute.py": "torch.utils.checkpoint on a stage's first N layers",
    "tests/dist/test_comm_dtype_p2p.py": "bf16 P2P between two gloo processes",
    "tests/unit/test_runtime_model.py": "DTensor TP layers built by the runtime",
    "tests/unit/test_runtime_topology.py": "process groups and device meshes of a plan",
    "tests/unit/test_runtime_trainer.py": "the trainer's step with torch's optimizers",
    "tests/unit/test_runtime_meta_build.py": "meta-device build and materialisation",
    "tests/unit/test_optimizer_state_init.py": "AdamW's lazily made state",
    # torch.compile on a block, the compiled loss
    "tests/unit/test_compiling.py": "torch.compile of the transformer blocks",
    "tests/unit/test_chunked_loss.py": "the compiled chunked loss against eager",
    "tests/unit/test_memory_model.py": "the attention kernel torch picks, counted in memory",
    # torchrun's agent and its signal handling; one launch -> shutdown -> resume
    "tests/dist/test_preempt.py::test_sigterm_to_the_agent_and_every_worker_at_once_is_one_notice": (  # noqa: E501
        "our handler in torchrun's elastic agent (a private torch name)"
    ),
    "tests/e2e/test_shutdown.py::test_a_shutdown_of_the_machine_running_launcher_and_workers_is_a_preemption": (  # noqa: E501
        "autohet launch under torchrun, a whole machine's SIGTERMs, the printed --resume"
    ),
}
