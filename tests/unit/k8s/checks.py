"""The one entry point to the cross-reference checks: every ``*_problems`` checker over a document list.

An empty list means the manifests agree with each other and with the code.
"""

from __future__ import annotations

from tests.unit.k8s.check_autoscaler import autoscaler_problems
from tests.unit.k8s.check_containers import container_problems
from tests.unit.k8s.check_nats import nats_problems
from tests.unit.k8s.check_wiring import reference_problems, selector_problems
from tests.unit.k8s.manifests import Doc
from tests.unit.test_compose import DOCKERFILE, user_owned_dirs


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
