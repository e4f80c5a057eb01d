// The core calls of E2B's JavaScript SDKs, for one release of them (copied beside that
// release's node_modules by tests/e2b/test_versions.py): create with the key as E2B's SDKs
// check it, run, files, list, connect, the code interpreter, kill.
import assert from 'node:assert/strict'

import { Sandbox } from 'e2b'
import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

assert.match(process.env.E2B_API_KEY, /^e2b_[0-9a-f]+$/)
delete process.env.E2B_VALIDATE_API_KEY // the SDK's own key check stays on

const sbx = await Sandbox.create('base', { timeoutMs: 120_000, metadata: { versions: 'core' } })
try {
  assert.equal((await sbx.commands.run('echo hi')).stdout, 'hi\n')
  await sbx.files.write('/home/user/v.txt', 'v')
  assert.equal(await sbx.files.read('/home/user/v.txt'), 'v')
  const listed = await Sandbox.list().nextItems()
  assert.ok(listed.some((s) => s.sandboxId === sbx.sandboxId))
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.commands.run('cat /home/user/v.txt')).stdout, 'v')
} finally {
  await sbx.kill()
}

const ci = await CodeSandbox.create({ timeoutMs: 120_000 })
try {
  assert.equal((await ci.runCode('1 + 1')).text, '2')
} finally {
  await ci.kill()
}
console.log('core calls ok with', process.argv.slice(2).join(' '))
