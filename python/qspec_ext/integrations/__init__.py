"""Integrations with serving engines (imported only by them: nothing in qspec_ext imports these)."""
