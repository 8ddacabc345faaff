"""Interdomain mixer core in three forms that compute the same numbers (see tests)."""
from .chunked import chunked_interdomain
from .naive import naive_interdomain
from .recurrent import StepTables, recurrent_interdomain, recurrent_step, step_tables

FORMS = {"chunked": chunked_interdomain, "recurrent": recurrent_interdomain, "naive": naive_interdomain}

__all__ = ["FORMS", "StepTables", "chunked_interdomain", "naive_interdomain",
           "recurrent_interdomain", "recurrent_step", "step_tables"]
