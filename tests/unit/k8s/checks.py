"""The one entry point to the cross-reference checks: every ``*_problems`` checker over a document list.

An empty list means the manifests agree with each other and with the code.
"""

from __future__ import annotations

from tests.unit.compose.compose_file import DOCKERFILE
from tests.unit.compose.dockerfile import user_owned_dirs
from tests.unit.k8s.check_autoscaler import autoscaler_problems
from tests.unit.k8s.check_containers import container_problems
from tests.unit.k8s.check_nats import nats_problems
from tests.unit.k8s.check_wiring import reference_problems, selector_problems
from tests.unit.k8s.manifests import Doc


def manifest_problems(docs: list[Doc]) -> list[str]:
    nats, facts = nats_problems(docs)
    uid = user_owned_dirs(DOCKERFILE.read_text()).uid
    return [
        *reference_problems(docs),
        *selector_problems(docs),
        *nats,
        *container_problems(docs, facts, uid),
        *autoscaler_problems(docs),
    ]
