"""Checks a user runs before serving: ``check_capture`` (does the step capture?) and the
divergence check (does replay equal eager?) with its report.

Uses ``_capture``; the runner uses it for ``BreakableGraphRunner.check_divergence``.
"""
