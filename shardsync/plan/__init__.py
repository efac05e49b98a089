"""Plans: copy lists between layouts, their buckets and the p2p preconditions."""

from shardsync.plan.bucket import Bucket, make_buckets
from shardsync.plan.local import allocate, execute_local
from shardsync.plan.plan import Copy, Plan, PlanError, Wire, build_plan

__all__ = ["Bucket", "Copy", "Plan", "PlanError", "Wire", "allocate", "build_plan", "execute_local", "make_buckets"]
