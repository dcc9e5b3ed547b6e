"""HMAC over weight-sync commands with ``WEIGHT_SYNC_SECRET``."""

from __future__ import annotations

import hashlib
import hmac

from tasks.schemas import SyncPlan


def sign_plan(plan: SyncPlan, secret: str) -> str:
    return hmac.new(secret.encode(), plan.signing_payload(), hashlib.sha256).hexdigest()


def plan_signature_ok(plan: SyncPlan, secret: str) -> bool:
    return bool(plan.hmac) and hmac.compare_digest(str(plan.hmac), sign_plan(plan, secret))
