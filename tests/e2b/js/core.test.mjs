// E2B's JavaScript SDKs (`e2b`, `@e2b/code-interpreter`, pinned in the Makefile), unmodified,
// against the gateway: create, commands, files, run_code, kill. Run by test_js.py with the
// gateway's E2B_* variables set.
import assert from 'node:assert/strict'
import { test } from 'node:test'

import { Sandbox, CommandExitError } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

test('create, commands, files, kill', async () => {
  const sbx = await Sandbox.create({ metadata: { suite: 'js' }, envs: { FOO: 'bar' } })
  try {
    const r = await sbx.commands.run('echo hi; echo $FOO; whoami')
    assert.equal(r.stdout, 'hi\nbar\nuser\n')
    assert.equal(r.exitCode, 0)
    await assert.rejects(sbx.commands.run('exit 5'), (e) => e instanceof CommandExitError && e.exitCode === 5)
    const h = await sbx.commands.run('sleep 1; echo later', { background: true })
    assert.equal((await h.wait()).stdout, 'later\n')
    await sbx.files.write('/home/user/a.txt', 'from js')
    assert.equal(await sbx.files.read('/home/user/a.txt'), 'from js')
    const bytes = new Uint8Array([0, 1, 2, 255])
    await sbx.files.write('/tmp/b.bin', bytes.buffer)
    assert.deepEqual(new Uint8Array(await sbx.files.read('/tmp/b.bin', { format: 'bytes' })), bytes)
    assert.ok((await sbx.files.list('/home/user')).some((e) => e.name === 'a.txt'))
    assert.equal(await sbx.files.exists('/nope'), false)
    assert.equal(await sbx.isRunning(), true)
    const listed = await Sandbox.list({ query: { metadata: { suite: 'js' } } }).nextItems()
    assert.ok(listed.some((s) => s.sandboxId === sbx.sandboxId))
  } finally {
    assert.equal(await Sandbox.kill(sbx.sandboxId), true)
  }
  assert.equal(await Sandbox.kill(sbx.sandboxId), false)
})

test('run_code', async () => {
  const ci = await CodeSandbox.create()
  try {
    const ex = await ci.runCode("print('hello'); 1+1")
    assert.deepEqual(ex.logs.stdout, ['hello\n'])
    assert.equal(ex.text, '2')
    await ci.runCode('x = 20')
    assert.equal((await ci.runCode('x * 2')).text, '40')
    const err = await ci.runCode('undefined_name')
    assert.equal(err.error.name, 'NameError')
  } finally {
    await ci.kill()
  }
})
