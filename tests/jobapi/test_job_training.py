"""A job trains on a prepared corpus through a GPU loss, is deleted whole and created again as a
user would, and finishes from its newest checkpoint with the losses of a run never interrupted.

On the job API's local cluster (2 nodes x 2 GPUs): the interpreter's standard library prepared
with `tessera prepare-data` onto a shared claim the trainers mount read-only, checkpoints on
another. The job (TP2 x DP2) trains; `tessera-dev fail-gpu gpu-node-1 1 --xid 79` takes a rank
down and its replica trains on at TP 1; once a checkpoint after that is complete the job is
deleted (`kubectl delete ntpjob`, every pod gone). The GPU is repaired (`tessera-dev
restore-gpu`; without it the node has too few GPUs for the job's pod) and the job created again
from the same manifest: it resumes from the newest checkpoint and completes (`kubectl wait
--for=condition=Complete`). The health agent holds the repaired GPU down for a minute, so the
job comes back on the reduced layout; were the GPU returned to it mid-run, the reference would
follow that layout too.

The reference is the same job without the deletion: the local launcher on the layouts the job
trained, in the same order, each from the step the job's first took effect and from the
checkpoint the one before it ended on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from hf_families import FAMILIES, save
from jobharness import GPUS, HANG_S, NODES, JobFlow, condition, records, shared, small_job
from kubernetes import client
from rounding import FLOAT32_ROUNDING, FLOAT64_ROUNDING, rounding_bound

from ntp.checkpoint import read_args
from ntp.data import split_inputs, synthetic_batch
from ntp.launch import launch_local
from tessera_contracts.api import ROLE_LABEL
from tessera_contracts.generation import Generation, Gpu, Rendezvous
from tessera_contracts.jobspec import NTPTrainingJobSpec
from tessera_dev import demo_data
from tessera_dev.reference import trainer_options
from tessera_dev.simnode import faults

pytestmark = [pytest.mark.jobapi, pytest.mark.e2e]

JOB = "resumed"
# Long enough that the deletion lands mid-run: the job trains on while it is deleted (180-250
# steps here, in the 9-11 s from `kubectl delete` to every pod gone), short enough to finish.
STEPS = 600
# The second attempt trains the rest (about 300 steps): a guard against a hang, long enough for
# a machine whose cores something else keeps busy (measured: 300 s was not, beside a CPU hog).
COMPLETE_S = 4 * HANG_S
INTERVAL, KEEP = 10, 2
# A prefix of the standard library: 12 files, about 44k tokens with its 512-token tokenizer.
CORPUS_BYTES = 300_000
LOST = ("gpu-node-1", 1)  # replica 1's second rank
TESSERA = str(Path(sys.executable).parent / "tessera")
Degrees = tuple[int, ...]  # the TP degree of each replica, in replica order


def _trainer_pods(flow: JobFlow) -> list[dict[str, Any]]:
    return [p for p in flow.pods(JOB) if p["metadata"]["labels"].get(ROLE_LABEL) == "trainer"]


def _steps(flow: JobFlow) -> list[dict[str, Any]]:
    """The step records in the job's trainer pods' logs now."""
    return [r for p in _trainer_pods(flow) for r in records(flow.logs(p["metadata"]["name"]))
            if "loss" in r]


def _complete(checkpoints: Path) -> dict[str, int]:
    """The complete checkpoints in the job's checkpoint directory: name -> the step its
    tessera.json holds (written last, before the rename that completes it)."""
    found: dict[str, int] = {}
    for d in checkpoints.glob("step-*"):
        if d.name.endswith(".partial"):
            continue
        try:
            found[d.name] = json.loads((d / "tessera.json").read_text())["step"]
        except FileNotFoundError:  # pruned while the job runs
            continue
    return found


def _follow(flow: JobFlow) -> list[subprocess.Popen[str]]:
    """`kubectl logs -f` of every trainer pod: each ends with its container, with every line the
    ranks printed up to their end (the pod, once deleted, has no logs to ask for)."""
    env = os.environ | {"KUBECONFIG": str(flow.plane.kubeconfig)}
    return [subprocess.Popen(["kubectl", "-n", flow.namespace, "logs", "-f", p["metadata"]["name"]],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for p in _trainer_pods(flow)]


def _last_losses(incarnations: list[list[dict[str, Any]]]) -> dict[int, tuple[float, Degrees]]:
    """Step -> (loss, TP degrees) of the last record of it: incarnations in order, and within
    one, generations in order (a later generation redoes the step its predecessor left)."""
    last: dict[int, tuple[float, Degrees]] = {}
    for steps in incarnations:
        for r in sorted(steps, key=lambda r: r["generation"]):  # stable: each pod's log order
            last[r["step"]] = (r["loss"], tuple(r["tp_degrees"]))
    return last


def _generations(steps: list[dict[str, Any]]) -> dict[int, tuple[int, int, Degrees]]:
    """Generation -> (first step, last step, TP degrees) of the records it trained."""
    spans: dict[int, tuple[int, int, Degrees]] = {}
    for r in steps:
        first, last, _ = spans.get(r["generation"], (r["step"], r["step"], ()))
        spans[r["generation"]] = (min(first, r["step"]), max(last, r["step"]),
                                  tuple(r["tp_degrees"]))
    return spans


def _phases(last: dict[int, tuple[float, Degrees]]) -> list[tuple[int, int, Degrees]]:
    """(first step, last step, TP degrees) of each run of steps trained on one layout."""
    phases: list[tuple[int, int, Degrees]] = []
    for step in sorted(last):
        degrees = last[step][1]
        if phases and phases[-1][2] == degrees:
            phases[-1] = (phases[-1][0], step, degrees)
        else:
            phases.append((step, step, degrees))
    return phases


def _uninterrupted(spec: dict[str, Any], phases: list[tuple[int, int, Degrees]], data: Path,
                   tmp: Path) -> dict[int, float]:
    """Global rank 0's losses by step of the same job on the local launcher, through `phases` in
    order, each from the checkpoint the one before it saved at its end; the options the
    operator gives the job's ranks, the dataset read where the trainer pods mount it from."""
    typed = NTPTrainingJobSpec.from_spec(spec)
    options = trainer_options(typed)
    losses: dict[int, float] = {}
    for k, (first, last, degrees) in enumerate(phases):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        replicas = tuple(tuple(Gpu(f"gpu-node-{r}", i) for i in range(tp))
                         for r, tp in enumerate(degrees))
        layout = Generation(1, typed.model.shape(), typed.global_batch,
                            typed.failure_policy.mode, replicas,
                            Rendezvous("127.0.0.1", store.port))
        out = tmp / f"phase{k}"
        # the dataset where this machine holds it, not where the pods mount it
        launch_local(layout, [*options, "--until-step", str(last),
                              "--save", str(tmp / "checkpoints"), "--resume",
                              "--data", str(data), "--out", str(out)],
                     timeout_s=HANG_S, store=store)
        ran = json.loads((out / "rank0.json").read_text())
        steps = sorted(map(int, ran["step_ends"]))
        assert steps == list(range(first, last + 1)), (k, first, last, steps)
        losses |= dict(zip(steps, ran["losses"], strict=True))
    return losses


def _gone(flow: JobFlow) -> bool:
    """No pod of the job and no layout ConfigMap left: a job of the same name created now is
    not refused the last one's."""
    try:
        client.CoreV1Api(flow.api).read_namespaced_config_map(f"{JOB}-layout", flow.namespace)
        return False
    except client.ApiException as exc:
        if exc.status != 404:
            raise
    return not flow.pods(JOB)


@pytest.mark.timeout(COMPLETE_S + 2 * HANG_S)  # the suite's 600 s guard, made for this flow
def test_a_job_deleted_after_a_gpu_loss_and_created_again_resumes_its_losses(flow, tmp_path):
    started = time.monotonic()
    data_claim, data_files = shared(flow, "corpus")
    checkpoint_claim, checkpoint_files = shared(flow, "checkpoints")
    job = small_job(JOB, checkpoint_claim, steps=STEPS, interval=INTERVAL, data=data_claim)
    job["spec"]["checkpointPolicy"]["keep"] = KEEP
    dataset = data_files / demo_data.data_claim(job).path
    prepared = subprocess.run(
        [TESSERA, "prepare-data", "--stdlib", "--max-bytes", str(CORPUS_BYTES),
         "--train-tokenizer", str(job["spec"]["model"]["vocab"]), "--out", str(dataset)],
        capture_output=True, text=True, timeout=HANG_S)
    assert prepared.returncode == 0, prepared.stderr
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    checkpoints = checkpoint_files / "run"

    # 1. The job trains on the corpus; a GPU falls off the bus under it.
    flow.kubectl("apply", "-f", str(manifest))
    flow.wait("the trainer pods running", lambda: _trainer_pods(flow),
              lambda pods: len(pods) == NODES and all(p["status"].get("phase") == "Running"
                                                  for p in pods))
    followers = _follow(flow)
    flow.wait("training past step 8", lambda: max((r["step"] for r in _steps(flow)), default=0),
              lambda step: step >= 8)
    assert faults.fail_gpu([*map(str, LOST), "--xid", "79", "--data-dir",
                            str(flow.plane.data_dir)]) == 0
    reduced = flow.wait("steps on the reduced layout", lambda: [
        r["step"] for r in _steps(flow) if r["tp_degrees"] == [2, 1]])
    loss_step = min(reduced)

    # 2. A checkpoint after the loss complete: the job deleted whole, mid-run.
    flow.wait("a checkpoint after the loss", lambda: _complete(checkpoints),
              lambda done: max(done.values(), default=0) >= loss_step)
    deleted = time.monotonic()
    flow.kubectl("delete", "ntpjob", JOB, "--wait=true")
    flow.wait("every pod of the job and its layout gone", lambda: _gone(flow))
    deletion_s = time.monotonic() - deleted
    first = [r for f in followers for r in records(f.communicate(timeout=HANG_S)[0].splitlines())
             if "loss" in r]
    done = _complete(checkpoints)
    assert len(done) <= KEEP, sorted(done)
    resume_at = max(done.values())
    assert loss_step <= resume_at < STEPS, (loss_step, sorted(done.values()))
    assert resume_at <= max(r["step"] for r in first)  # the logs hold every step it saved

    # 3. Created again from the same manifest once the GPU is back: it resumes and completes.
    assert faults.restore_gpu([*map(str, LOST), "--data-dir", str(flow.plane.data_dir)]) == 0
    flow.kubectl("apply", "-f", str(manifest))
    waited = flow.kubectl("wait", "--for=condition=Complete", f"ntpjob/{JOB}",
                          f"--timeout={COMPLETE_S:.0f}s", check=False, timeout=COMPLETE_S + 30)
    assert waited.returncode == 0, (waited.stderr, flow.status(JOB))
    assert condition(flow.status(JOB), "Complete")["status"] == "True"
    second = _steps(flow)
    assert min(r["step"] for r in second) == resume_at + 1
    done = _complete(checkpoints)
    assert len(done) <= KEEP and max(done.values()) == STEPS, sorted(done.items())
    cluster_s = time.monotonic() - started

    # 4. Every step's last loss, across both, is the uninterrupted run's, exactly. The user
    #    flow's 1e-4 bounds a reference on another layout (other summation orders in float32);
    #    here each step runs on the layout the job ran it on: the same operations on the same
    #    values in the same order. A live reshard and a checkpoint restore hand the next layout
    #    the same float32 values, the dataset gives every layout the same rows at a step
    #    (docs/data.md), and gloo's reductions are deterministic (trainer_image/ntp/README.md).
    last = _last_losses([first, second])
    assert sorted(last) == list(range(1, STEPS + 1))
    phases = _phases(last)
    # on a failure, what each generation of the first incarnation trained says which path it took
    trained = _generations(first)
    assert phases[0][:2] == (1, loss_step - 1) and phases[0][2] == (2, 2), (phases, trained)
    assert phases[1][0] == loss_step and phases[1][2] == (2, 1), (phases, trained)
    reference = _uninterrupted(job["spec"], phases, dataset, tmp_path / "reference")
    assert {s: loss for s, (loss, _) in last.items()} == reference
    print(f"\n{STEPS} steps: the GPU lost at step {loss_step}, deleted ({deletion_s:.1f} s to "
          f"every pod gone) after step {max(r['step'] for r in first)}, resumed at step "
          f"{resume_at + 1}; layouts "
          f"{[(a, b, ','.join(map(str, d))) for a, b, d in phases]}; cluster part "
          f"{cluster_s:.0f} s, reference {time.monotonic() - started - cluster_s:.0f} s")


# Two jobs, one per node (TP2, one replica each), from Hugging Face directories on a claim.
FAMILY_STEPS = 12
FAMILY_BATCH = 4
# Tiny random models no other test uses: Qwen3 (its own head size, QK norms, a tied head) and
# Llama 3.1 (llama3 RoPE scaling), each with a tokenizer and a generation config.
FAMILY_JOBS = {
    "qwen3": ("qwen3", dict(
        hidden_size=36, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
        intermediate_size=44, vocab_size=59, num_hidden_layers=2, max_position_embeddings=12,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True)),
    "llama31": ("llama3.1", dict(
        hidden_size=40, num_attention_heads=4, num_key_value_heads=1, intermediate_size=52,
        vocab_size=61, num_hidden_layers=2, max_position_embeddings=12,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
}


def _family_job(name: str, weights: str, checkpoints: str, model: dict[str, Any]
                ) -> dict[str, Any]:
    """The small job as one TP2 replica on one node, starting from /weights/NAME, saving every
    step (the last two kept: the weights the last reported loss was computed with)."""
    job = small_job(name, checkpoints, steps=FAMILY_STEPS, interval=1)
    spec = job["spec"]
    spec |= {"model": model, "dataParallelReplicas": 1, "totalGPUs": GPUS,
             "globalBatch": FAMILY_BATCH, "initialWeights": {"path": f"/weights/{name}"}}
    spec["checkpointPolicy"] |= {"path": f"/checkpoints/{name}", "keep": 2}
    pod = spec["template"]["spec"]
    pod["volumes"].append({"name": "weights", "persistentVolumeClaim": {
        "claimName": weights, "readOnly": True}})
    pod["containers"][0]["volumeMounts"].append(
        {"name": "weights", "mountPath": "/weights", "readOnly": True})
    return job


def _running_trainer(flow: JobFlow, name: str) -> dict[str, Any]:
    """The job's running trainer pod; if none comes, the job's status and its pods say why."""
    try:
        return flow.wait(f"{name}'s trainer pod running", lambda: [
            p for p in flow.pods(name) if p["metadata"]["labels"].get(ROLE_LABEL) == "trainer"
            and p["status"].get("phase") == "Running"])[0]
    except AssertionError as exc:
        pods = [(p["metadata"]["name"], p["status"].get("phase"), p["status"].get("conditions"))
                for p in flow.pods(name)]
        raise AssertionError(f"{exc}; status {flow.status(name)}; pods {pods}") from None


@pytest.mark.models
@pytest.mark.timeout(3 * HANG_S)
def test_jobs_from_qwen3_and_llama31_directories_train_through_a_gpu_loss_and_export(
    flow, tmp_path
):
    weights_claim, weights = shared(flow, "weights")
    checkpoint_claim, checkpoints = shared(flow, "checkpoints")
    # 1. Each family's directory as transformers saves it, in bfloat16, with a tokenizer; the
    #    job's spec.model is what `tessera import-hf` prints for it.
    models = {}
    for name, (family, shape) in FAMILY_JOBS.items():
        source = replace(FAMILIES[family], shape=shape).build(seed=7)
        directory = save(source, weights / name, torch.bfloat16)
        (directory / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}')
        (directory / "tokenizer_config.json").write_text('{"model_max_length": 12}')
        models[name] = (FAMILIES[family].model, read_args(directory))
        manifest = tmp_path / f"{name}.yaml"
        manifest.write_text(yaml.safe_dump(_family_job(
            name, weights_claim, checkpoint_claim, models[name][1].shape().to_spec())))
        flow.kubectl("apply", "-f", str(manifest))
    # 2. Both train; each loses a GPU of its node under it and goes on at TP1.
    pods = {name: _running_trainer(flow, name) for name in FAMILY_JOBS}
    for name, pod in pods.items():
        pod_name = pod["metadata"]["name"]
        flow.wait(f"{name} training past step 3", lambda p=pod_name: max(
            (r["step"] for r in records(flow.logs(p)) if "loss" in r), default=0),
            lambda step: step >= 3)
        assert faults.fail_gpu([pod["spec"]["nodeName"], "1", "--xid", "79", "--data-dir",
                                str(flow.plane.data_dir)]) == 0
    for name, pod in pods.items():
        waited = flow.kubectl("wait", "--for=condition=Complete", f"ntpjob/{name}",
                              f"--timeout={HANG_S:.0f}s", check=False, timeout=HANG_S + 30)
        assert waited.returncode == 0, (waited.stderr, flow.status(name))
        assert faults.restore_gpu([pod["spec"]["nodeName"], "1", "--data-dir",
                                   str(flow.plane.data_dir)]) == 0
    # 3. Exported at the end (the newest checkpoint) with the tokenizer, and the weights the last
    #    reported loss was computed with (the checkpoint before): transformers computes that loss
    #    on the same batch.
    for name, (model_class, args) in models.items():
        steps = [r for r in records(flow.logs(pods[name]["metadata"]["name"])) if "loss" in r]
        last = max(steps, key=lambda r: (r["step"], r["generation"]))
        assert last["step"] == FAMILY_STEPS and last["tp_degrees"] == [1], last
        assert any(r["tp_degrees"] == [2] for r in steps)
        job_dir = checkpoints / name
        for given, out in ((job_dir, tmp_path / f"{name}-end"),
                           (job_dir / f"step-{FAMILY_STEPS - 1:08d}", tmp_path / f"{name}-last")):
            exported = subprocess.run([TESSERA, "export-hf", str(given), str(out)],
                                      capture_output=True, text=True, timeout=HANG_S)
            assert exported.returncode == 0, exported.stderr
            for carried in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
                assert (out / carried).read_bytes() == (weights / name / carried).read_bytes()
        model = model_class.from_pretrained(tmp_path / f"{name}-last",
                                            attn_implementation="eager")
        inputs, targets = split_inputs(synthetic_batch(
            args.vocab_size, args.max_seq_len, FAMILY_BATCH, FAMILY_STEPS - 1, seed=0))
        with torch.no_grad():
            theirs = float(F.cross_entropy(model(inputs).logits.flatten(0, 1),
                                           targets.flatten()))
        # Two float32 evaluations of one loss, each within (u32 + u64) x the operations on the
        # longest dependency path (`rounding_bound`, tests/ntp/test_model.py) of the exact one.
        operations = rounding_bound(args, FAMILY_BATCH) / (2 * FLOAT64_ROUNDING)
        bound = 2 * (FLOAT32_ROUNDING + FLOAT64_ROUNDING) * operations
        assert abs(last["loss"] - theirs) <= bound * abs(theirs), (name, last["loss"], theirs)
        print(f"\n[{name}] last reported loss (step {FAMILY_STEPS}) {last['loss']:.7f}, "
              f"transformers on the exported weights {theirs:.7f}, relative difference "
              f"{abs(last['loss'] - theirs) / theirs:.1e} (bound {bound:.1e})")
