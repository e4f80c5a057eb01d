
edge-000.abc	session-1echo hi