"""The OS side of containment: processes, cgroups, identities, the user's tree, safe file access.

Knows no attempt, job or request: never imports another daemon subpackage but the config.
"""
