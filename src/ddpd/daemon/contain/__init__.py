"""The OS side of containment: processes, cgroups, identities, helper processes (their cgroups,
bounded runs and ends, `helpers`), the user's tree, safe file access, port fences and the reaping of
inherited children.

Knows no attempt, job or request.

May import: protocol, config, layout.
Never imports: store, pool, gpu, ranklogs, run, multinode, attempt, queue, control, app, main.
"""
