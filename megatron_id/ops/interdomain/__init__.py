"""Interdomain mixer core in three forms that compute the same numbers (see tests).

Every form has one signature and always returns a pair, flash-linear-attention's convention:

    out, final_state = FORMS[form](q, k, v, log_dt, a_log, a_im, c_re, c_im, readout=...,
                                   c_vec=None, initial_state=None, output_final_state=False)

final_state ([B, H, M, R + Dv] complex) is None unless output_final_state=True.
"""
from .chunked import chunked_interdomain
from .naive import naive_interdomain
from .recurrent import StepTables, recurrent_interdomain, recurrent_step, step_tables

FORMS = {"chunked": chunked_interdomain, "recurrent": recurrent_interdomain, "naive": naive_interdomain}

__all__ = ["FORMS", "StepTables", "chunked_interdomain", "naive_interdomain",
           "recurrent_interdomain", "recurrent_step", "step_tables"]
