"""A SimpleAuthManager that also denies listed (user, DAG id) pairs.

The SimpleAuthManager grants by role only (viewer reads every DAG); a per-DAG refusal,
as FAB or Keycloak deployments configure it, needs this one override. Tokens, login and
every other decision stay the SimpleAuthManager's own. ``CKPT_TEST_DENIED_DAGS`` holds
``user:dag_id`` pairs separated by commas.
"""

from __future__ import annotations

import os

from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager


def denied_pairs() -> set[tuple[str, str]]:
    pairs = (p.split(":", 1) for p in os.environ.get("CKPT_TEST_DENIED_DAGS", "").split(",") if p)
    return {(user, dag_id) for user, dag_id in pairs}


class DenyingAuthManager(SimpleAuthManager):
    def is_authorized_dag(self, *, method, user, access_entity=None, details=None) -> bool:
        if details is not None and (user.get_name(), details.id) in denied_pairs():
            return False
        return super().is_authorized_dag(method=method, user=user, access_entity=access_entity,
                                         details=details)
