"""The committed stubs in services/api are exactly what `python -m services.api.codegen` makes."""

from pathlib import Path

from services.api import codegen


def test_generated_stubs_are_up_to_date(tmp_path):
    fresh = {p.name: p.read_text() for p in codegen.generate(tmp_path)}
    committed = {p.name: p.read_text() for p in codegen.PACKAGE_DIR.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "stub files differ: run python -m services.api.codegen"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python -m services.api.codegen"


def test_every_proto_service_is_generated():
    from services.api import coordinator_pb2, rollout_pb2, trainer_pb2

    names = {
        trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name,
        rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name,
        coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    }
    assert names == {"rlfleet.v1.Trainer", "rlfleet.v1.Rollout", "rlfleet.v1.Coordinator"}
    assert Path(codegen.PROTO_ROOT, "rlfleet/v1/weights.proto").exists()
