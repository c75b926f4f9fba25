"""The Kubernetes and SkyPilot launch files of a bake, validated offline against the controllers'
own schemas: core kinds (the volume claim, the JobSet's pods) with kubernetes-validate, strict;
the TrainJob and the JobSet with the Kubeflow Trainer API's models, every key of the file walked
against their fields (the models themselves let unknown keys through); sky/train.yaml against
SkyPilot's schemas, vendored in tests/schemas/skypilot.json (skypilot itself needs click<8.2,
which this environment cannot hold beside wandb and huggingface_hub)."""

import json
import types
import typing
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubeflow_trainer_api.models import JobsetV1alpha2JobSet, TrainerV1alpha1TrainJob
from pydantic import BaseModel

K8S_VERSION = "1.37.0"
SKY_SCHEMAS = json.loads((Path(__file__).parent / "schemas" / "skypilot.json").read_text())
ANSWERS = {"num_nodes": "2", "gpus_per_node": "8", "cpus_per_gpu": "6", "micro_batch_size": "4",
           "global_batch_size": "64", "container_image": "ghcr.io/my-team/acme-train:1.0"}
MODELS = {"TrainJob": TrainerV1alpha1TrainJob, "JobSet": JobsetV1alpha2JobSet}


def unknown_keys(model: type[BaseModel], data: dict, path: str = "") -> list[str]:
    """The keys of `data`, at any depth, that are no field (by its alias) of `model` or of the
    model a field holds."""
    fields = {field.alias or name: field.annotation for name, field in model.model_fields.items()}
    found = []
    for key, value in data.items():
        if key not in fields:
            found.append(f"{path}.{key}")
        else:
            found += unknown_in(fields[key], value, f"{path}.{key}")
    return found


def unknown_in(annotation, value, path: str) -> list[str]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[X]
        models = [a for a in args if a is not type(None)]
        return unknown_in(models[0], value, path) if len(models) == 1 else []
    if origin is list and isinstance(value, list):
        return [key for i, item in enumerate(value) for key in unknown_in(args[0], item, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        return [key for k, item in value.items() for key in unknown_in(args[1], item, f"{path}.{k}")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        return unknown_keys(annotation, value, path)
    return []


def checked_custom_resource(doc: dict):
    """A TrainJob or JobSet through its model (types, required fields) and the walk (no unknown key)."""
    model = MODELS[doc["kind"]]
    assert unknown_keys(model, doc) == []
    return model.from_dict(doc)


def documents(path: Path) -> dict[str, dict]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text())}


def env_of(entries: list[dict]) -> dict[str, dict]:
    return {entry["name"]: entry for entry in entries}


def assert_secret_key(env: dict[str, dict]) -> None:
    """The W&B key comes from the Secret, never a value written in the file."""
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY",
                                    "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}


@pytest.fixture(scope="module")
def project(baked):
    return baked(**ANSWERS)


def test_trainjob_is_a_valid_kubeflow_trainer_v2_job(project):
    docs = documents(project / "k8s" / "trainjob.yaml")
    assert set(docs) == {"PersistentVolumeClaim", "TrainJob"}
    kubernetes_validate.validate(docs["PersistentVolumeClaim"], K8S_VERSION, strict=True)
    job = checked_custom_resource(docs["TrainJob"])
    assert docs["TrainJob"]["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job.spec.runtime_ref.name == "torch-distributed"
    trainer = job.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (2, 8)
    assert trainer.image == "ghcr.io/my-team/acme-train:1.0"
    limits = docs["TrainJob"]["spec"]["trainer"]["resourcesPerNode"]["limits"]
    assert limits == {"nvidia.com/gpu": 8, "cpu": 48}
    assert trainer.command == ["/workspace/scripts/node_launch.sh"]
    env = env_of(docs["TrainJob"]["spec"]["trainer"]["env"])
    assert_secret_key(env)
    pod = job.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0].template.spec.template.spec
    assert pod.termination_grace_period_seconds >= 120
    mounts = {m.name: m.mount_path for m in pod.containers[0].volume_mounts}
    claims = {v.name: v.persistent_volume_claim.claim_name for v in pod.volumes if v.persistent_volume_claim}
    assert mounts["runs"] == env["OUTPUT_DIR"]["value"] and claims == {"runs": docs["PersistentVolumeClaim"]
                                                                       ["metadata"]["name"]}


def test_jobset_is_a_valid_jobset_with_valid_pods(project):
    docs = documents(project / "k8s" / "jobset.yaml")
    assert set(docs) == {"PersistentVolumeClaim", "JobSet"}
    kubernetes_validate.validate(docs["PersistentVolumeClaim"], K8S_VERSION, strict=True)
    jobset = checked_custom_resource(docs["JobSet"])
    assert docs["JobSet"]["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert jobset.spec.network.enable_dns_hostnames and jobset.spec.failure_policy.max_restarts >= 1
    [replicated] = docs["JobSet"]["spec"]["replicatedJobs"]
    # each replicated Job is a batch/v1 Job: its pods, env, volumes and Secret refs checked strictly
    kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "node"},
                                  **replicated["template"]}, K8S_VERSION, strict=True)
    job = replicated["template"]["spec"]
    assert (replicated["replicas"], job["parallelism"], job["completions"]) == (1, 2, 2)
    assert job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 120
    [container] = pod["containers"]
    assert container["command"] == ["/workspace/scripts/node_launch.sh"]
    assert container["image"] == "ghcr.io/my-team/acme-train:1.0"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": 48}
    env = env_of(container["env"])
    assert_secret_key(env)
    label = env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    # pod 0 of replicated job "node" under the headless service the JobSet names after itself
    assert env["MASTER_ADDR"]["value"] == "$(JOBSET_NAME)-node-0-0.$(JOBSET_NAME)"
    assert (env["NNODES"]["value"], env["NPROC_PER_NODE"]["value"]) == ("2", "8")
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["runs"] == env["OUTPUT_DIR"]["value"]


def test_sky_task_is_valid_for_skypilot(project):
    task = yaml.safe_load((project / "sky" / "train.yaml").read_text())
    jsonschema.validate(task, SKY_SCHEMAS["task"])
    jsonschema.validate(task["resources"], SKY_SCHEMAS["resources"])
    for mount in task["file_mounts"].values():
        jsonschema.validate(mount, SKY_SCHEMAS["storage"])
    assert task["num_nodes"] == 2
    assert task["resources"]["accelerators"] == {"H100": 8, "A100-80GB": 8, "A100": 8}
    assert task["resources"]["cpus"] == "48+"
    assert task["resources"]["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
    assert task["run"].strip() == "scripts/node_launch.sh"
    assert task["secrets"] == {"WANDB_API_KEY": None} and "WANDB_API_KEY" not in task["envs"]
    assert set(task["file_mounts"]) == {task["envs"]["OUTPUT_DIR"]}


@pytest.mark.parametrize("kind,path,key", [("TrainJob", ["spec", "trainer"], "numNode"),
                                           ("TrainJob", ["spec", "runtimeRef"], "nmae"),
                                           ("JobSet", ["spec", "failurePolicy"], "maxRestart"),
                                           ("JobSet", ["spec", "replicatedJobs", 0, "template", "spec", "template",
                                                       "spec", "containers", 0], "enviroment")])
def test_a_misspelt_key_is_found(project, kind, path, key):
    """The models accept an unknown key; the walk does not."""
    doc = documents(project / "k8s" / ("trainjob.yaml" if kind == "TrainJob" else "jobset.yaml"))[kind]
    MODELS[kind].from_dict(doc)
    place = doc
    for step in path:
        place = place[step]
    place[key] = 1
    assert MODELS[kind].from_dict(doc) is not None
    found = unknown_keys(MODELS[kind], doc)
    assert len(found) == 1 and found[0].endswith(f".{key}"), found


def test_a_wrong_key_or_type_is_refused_by_the_other_validators(project):
    docs = documents(project / "k8s" / "jobset.yaml")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "node"},
           **docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]}
    job["spec"]["template"]["spec"]["containers"][0]["env"][-1]["valueFrom"]["secretKeyRef"]["keys"] = "api-key"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    task = yaml.safe_load((project / "sky" / "train.yaml").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task, "num_node": 2}, SKY_SCHEMAS["task"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**task["resources"], "job_recovery": {"max_restarts_on_errors": -1}},
                            SKY_SCHEMAS["resources"])
