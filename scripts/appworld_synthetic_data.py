"""Write a small AppWorld data root of synthetic tasks in AppWorld's own on-disk format.

Run with the AppWorld venv's python (it imports appworld): `.venv-appworld/bin/python
scripts/appworld_synthetic_data.py ROOT`. It writes ROOT/data/tasks/<scenario>_<n>/ (specs.json, dbs/ (every app's)
built empty with `ModelCollection.load(..., create_db=True)` plus the supervisor, the active task and the API docs, and
ground_truth/ with metadata.json, evaluation.py, answer.json ...), ROOT/data/datasets/<split>.txt and
ROOT/data/api_docs/ (generated from the installed apps, as AppWorld builds it). The
official data (`appworld download data`) has the same layout; these tasks only need no download.

Every task asks a question whose answer goes to `apis.supervisor.complete_task(answer=...)`; its two unit
tests check that the task was marked complete and that the answer is right (so dense = 0.5 for a wrong
answer). Difficulty 1 asks for a sum, 2 for a fact from the supervisor's profile, 3 for both combined.
"""

import json
import os
import sys
from textwrap import dedent

SUPERVISOR = {"first_name": "Ada", "last_name": "Park", "email": "ada.park@example.com", "phone_number": "5550100123"}
DATETIME = "2023-05-18T12:00:00"
EVALUATION = dedent(
    """
    import json


    def evaluate(test, public_data, private_data, main_user, models, ground_truth_answer):
        task = models.end.supervisor.Task.all()[0]
        with test("the task is marked complete"):
            test.case(task.status, "==", "success")
        with test("the answer is right"):
            test.answer(json.loads(task.answer), ground_truth_answer)
    """
).lstrip()
# (scenario, split, difficulty, [(instruction, answer) per task])
SCENARIOS = [
    ("a1a1a1a", "train", 1, [("What is 17 plus 25?", 42), ("What is 3 plus 4?", 7), ("What is 10 plus 90?", 100)]),
    (
        "b2b2b2b",
        "train",
        2,
        [
            ("What is my phone number?", SUPERVISOR["phone_number"]),
            ("What is my email address?", SUPERVISOR["email"]),
            ("What is my last name?", SUPERVISOR["last_name"]),
        ],
    ),
    ("c3c3c3c", "dev", 3, [("What is my first name followed by the sum of 2 and 2, with no space?", "Ada4")]),
    ("d4d4d4d", "test_normal", 1, [("What is 1 plus 1?", 2)]),
    ("e5e5e5e", "test_challenge", 2, [("What is my first name?", SUPERVISOR["first_name"])]),
]


def write_json(value, path: str) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=1)


def write_task(data: str, task_id: str, instruction: str, answer, difficulty: int, api_docs: dict) -> None:
    from appworld.apps import get_all_apps
    from appworld.apps.model_lib import get_db_home_path
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION

    task_dir = os.path.join(data, "tasks", task_id)
    os.makedirs(os.path.join(task_dir, "ground_truth"))
    specs = {
        "instruction": instruction,
        "supervisor": SUPERVISOR,
        "datetime": DATETIME,
        "db_version": DB_VERSION,
        "canary_string": CANARY_STRING,
    }
    write_json(specs, os.path.join(task_dir, "specs.json"))

    memory = get_db_home_path(storage_type="memory", type="task_input", task_id=task_id)
    base = os.path.join(data, "base_dbs")
    models = ModelCollection.load(to_db_home_path=memory, from_db_home_path=base, load_apps=get_all_apps())
    supervisor = models.supervisor.Supervisor.find_one(email=SUPERVISOR["email"])
    models.supervisor.Task.create(supervisor_id=supervisor.id, instruction=instruction).save()
    models.save(db_home_path=os.path.join(task_dir, "dbs"), app_names=get_all_apps(), format="changes")

    ground_truth = os.path.join(task_dir, "ground_truth")
    metadata = {
        "difficulty": difficulty,
        "mode": "minimal",
        "num_apps": 1,
        "num_apis": 1,
        "num_api_calls": 1,
        "num_solution_code_lines": 1,
    }  # the counts a minimal-mode ground truth must carry
    write_json(metadata, os.path.join(ground_truth, "metadata.json"))
    with open(os.path.join(ground_truth, "evaluation.py"), "w") as file:
        file.write(EVALUATION)
    with open(os.path.join(ground_truth, "answer.json"), "w") as file:
        file.write(json.dumps(answer))
    write_json({}, os.path.join(ground_truth, "public_data.json"))
    write_json({}, os.path.join(ground_truth, "private_data.json"))
    tests = [
        {"requirement": "the task is marked complete", "label": "no_op_fail"},
        {"requirement": "the answer is right", "label": "no_op_fail"},
    ]
    write_json(tests, os.path.join(ground_truth, "test_data.json"))


def write_base_dbs(data: str, api_docs: dict) -> None:
    """data/base_dbs/: every app's database with the supervisor and the API docs; a task's dbs/ hold its changes
    (its active task), as in the official data."""
    from appworld.apps import get_all_apps
    from appworld.apps.model_lib import get_db_home_path
    from appworld.collections.models import ModelCollection

    memory = get_db_home_path(storage_type="memory", type="base")
    models = ModelCollection.load(
        to_db_home_path=memory, from_db_home_path=memory, load_apps=get_all_apps(), create_db=True
    )
    models.supervisor.Supervisor.create(**SUPERVISOR, birthday="1990-01-01").save()
    models.admin.MainUser.create(**SUPERVISOR, birthday="1990-01-01").save()
    for app_name, docs in api_docs.items():  # what `apis.api_docs.*` serves
        for doc in docs.values():
            fields = {
                key: doc[key] for key in ("api_name", "path", "method", "description", "parameters", "response_schemas")
            }
            models.api_docs.ApiDoc.create(app_name_=app_name, **fields).save()
    models.save(db_home_path=os.path.join(data, "base_dbs"), app_names=get_all_apps(), format="full")


def main(root: str) -> None:
    from appworld import update_root
    from appworld.collections.api_docs import ApiDocCollection
    from appworld.common.constants import CANARY_STRING

    update_root(os.path.abspath(root))
    data = os.path.join(root, "data")
    os.makedirs(os.path.join(data, "datasets"))
    os.makedirs(os.path.join(data, "api_docs", "standard"))
    api_docs = ApiDocCollection.build()
    for app_name, docs in api_docs.items():  # as `ApiDocCollection.save` writes them
        write_json(
            {name: {**doc, "canary_string": CANARY_STRING} for name, doc in docs.items()},
            os.path.join(data, "api_docs", "standard", f"{app_name}.json"),
        )
    write_base_dbs(data, api_docs)
    splits: dict[str, list[str]] = {"train": [], "dev": [], "test_normal": [], "test_challenge": []}
    for scenario, split, difficulty, tasks in SCENARIOS:
        for number, (instruction, answer) in enumerate(tasks, start=1):
            task_id = f"{scenario}_{number}"
            write_task(data, task_id, instruction, answer, difficulty, api_docs)
            splits[split].append(task_id)
    for split, task_ids in splits.items():
        with open(os.path.join(data, "datasets", f"{split}.txt"), "w") as file:
            file.write("\n".join(task_ids) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
