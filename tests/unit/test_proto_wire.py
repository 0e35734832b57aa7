"""The wire format: message, field names and numbers as torchft's (section 1.2),
and ftdist's own service, which released clients already call."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ftdist._rpc._proto import ftdist_pb2, torchft_pb2
from ftdist.lighthouse.types import QuorumMember

# (message, {field name: number}) from torchft's proto, including the fields
# its 2026 wheels added; ftdist's own extensions use numbers >= 100.
TORCHFT = {
    "QuorumMember": {
        "replica_id": 1,
        "address": 2,
        "store_address": 3,
        "step": 4,
        "world_size": 5,
        "shrink_only": 6,
        "data": 7,
        "commit_failures": 8,
        "reconfigure_handles": 9,
    },
    "Quorum": {"quorum_id": 1, "participants": 2, "created": 3},
    "LighthouseQuorumRequest": {"requester": 1},
    "LighthouseQuorumResponse": {"quorum": 1},
    "LighthouseHeartbeatRequest": {"replica_id": 1},
    "ManagerQuorumRequest": {
        "group_rank": 1,
        "step": 2,
        "checkpoint_metadata": 3,
        "shrink_only": 4,
        "init_sync": 5,
        "commit_failures": 6,
        "reconfigure_handle": 7,
    },
    "ManagerQuorumResponse": {
        "quorum_id": 1,
        "recover_src_manager_address": 2,
        "recover_src_replica_rank": 3,
        "recover_dst_replica_ranks": 4,
        "store_address": 5,
        "max_step": 6,
        "max_replica_rank": 7,
        "max_world_size": 8,
        "replica_rank": 9,
        "replica_world_size": 10,
        "heal": 11,
        "commit_failures": 12,
        "replica_ids": 13,
        "reconfigure_handles": 14,
    },
    "CheckpointMetadataRequest": {"rank": 1},
    "CheckpointMetadataResponse": {"checkpoint_metadata": 1},
    "ShouldCommitRequest": {"should_commit": 1, "group_rank": 2, "step": 3},
    "ShouldCommitResponse": {"should_commit": 1},
    "KillRequest": {"msg": 1},
}


@pytest.mark.parametrize("message", sorted(TORCHFT))
def test_fields_match_torchft(message: str) -> None:
    descriptor = torchft_pb2.DESCRIPTOR.message_types_by_name[message]
    fields = {f.name: f.number for f in descriptor.fields}
    for name, number in TORCHFT[message].items():
        assert fields.get(name) == number, f"{message}.{name}"
    extras = {n: num for n, num in fields.items() if n not in TORCHFT[message]}
    assert all(num >= 100 for num in extras.values()), f"{message}: {extras} collide with torchft"


def test_services_and_methods() -> None:
    services = {
        s.name: [m.name for m in s.methods]
        for s in torchft_pb2.DESCRIPTOR.services_by_name.values()
    }
    assert services["LighthouseService"] == ["Quorum", "Heartbeat"]
    assert services["ManagerService"] == ["Quorum", "CheckpointMetadata", "ShouldCommit", "Kill"]
    assert torchft_pb2.DESCRIPTOR.package == "torchft"


def test_optional_fields_keep_presence() -> None:
    response = torchft_pb2.ManagerQuorumResponse()
    assert not response.HasField("recover_src_replica_rank")
    response.recover_src_replica_rank = 0
    assert response.HasField("recover_src_replica_rank")


# ftdist's own protocol: changing a number or a method breaks clients of
# other ftdist versions, so additions only.
FTDIST = {
    "SubscribeRequest": {"replica_id": 1, "listener": 2},
    "LighthouseEvent": {
        "kind": 1,
        "quorum_id": 2,
        "replica_id": 3,
        "reason": 4,
        "time": 5,
        "replica_ids": 6,
    },
    "StatusRequest": {},
    "StatusResponse": {"status_json": 1},
    "LeaveRequest": {"replica_id": 1},
    "LeaveResponse": {},
    "HealReport": {
        "replica_id": 1,
        "phase": 2,
        "step": 3,
        "quorum_id": 4,
        "quorum_s": 5,
        "reconfigure_s": 6,
        "transfer_s": 7,
        "load_s": 8,
        "transfer_bytes": 9,
        "error": 10,
        "bytes_done": 11,
    },
    "HealReportResponse": {},
}


@pytest.mark.parametrize("message", sorted(FTDIST))
def test_ftdist_fields(message: str) -> None:
    descriptor = ftdist_pb2.DESCRIPTOR.message_types_by_name[message]
    assert {f.name: f.number for f in descriptor.fields} == FTDIST[message]


def test_ftdist_service() -> None:
    assert ftdist_pb2.DESCRIPTOR.package == "ftdist"
    service = ftdist_pb2.DESCRIPTOR.services_by_name["LighthouseEvents"]
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in service.methods
    }
    assert methods == {
        "Subscribe": ("SubscribeRequest", "LighthouseEvent", True),
        "Status": ("StatusRequest", "StatusResponse", False),
        "Leave": ("LeaveRequest", "LeaveResponse", False),
        "ReportHeal": ("HealReport", "HealReportResponse", False),
    }
    assert list(ftdist_pb2.DESCRIPTOR.services_by_name) == ["LighthouseEvents"]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"data": '{"k": [1, 2]}', "commit_failures": 3, "reconfigure_handles": ["h0", "h1"]},
        {"data": "not json", "shrink_only": True},
    ],
)
def test_a_quorum_member_from_the_wire_keeps_every_field(extra: dict[str, object]) -> None:
    fields = {
        "replica_id": "r1",
        "address": "http://h:1",
        "store_address": "h:2",
        "step": 7,
        "world_size": 4,
        "shrink_only": False,
        **extra,
    }
    member = QuorumMember.from_proto(torchft_pb2.QuorumMember(**fields))  # type: ignore[arg-type]
    got = dataclasses.asdict(member)
    raw = fields.get("data")
    expected_data = None
    if raw == "not json":
        expected_data = {"raw": "not json"}
    elif raw is not None:
        expected_data = json.loads(str(raw))
    assert got == {
        **fields,
        "data": expected_data,
        "commit_failures": fields.get("commit_failures", 0),
        "reconfigure_handles": tuple(fields.get("reconfigure_handles", ())),  # type: ignore[arg-type]
    }
