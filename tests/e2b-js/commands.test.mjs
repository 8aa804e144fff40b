// E2B's `e2b` npm package running commands and terminals through the gateway's envd
// (docs/e2b.md "The in-sandbox API"), in real containers: exact output, exit codes, the
// errors the SDK throws, background commands, stdin, timeouts and terminals.

import assert from 'node:assert/strict'
import { after, before, test } from 'node:test'

import { CommandExitError, InvalidArgumentError, NotFoundError, Sandbox, SandboxError, TimeoutError } from 'e2b'

import { exists, pids, rejectsWith, sleeps, waitUntil } from './helpers.mjs'

let sbx

before(async () => {
  sbx = await Sandbox.create({ envs: { FROM_CREATE: 'made', SHADOWED: 'create' } })
})

after(async () => {
  await sbx?.kill()
})

test('stdout and stderr are kept apart, with the exit code', async () => {
  const r = await sbx.commands.run("echo out; echo err >&2; printf 'no newline'")
  assert.deepEqual({ stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode }, {
    stdout: 'out\nno newline',
    stderr: 'err\n',
    exitCode: 0,
  })
  // Output as it comes, through the callbacks.
  const out = []
  const err = []
  const r2 = await sbx.commands.run('for i in 1 2 3; do echo $i; echo e$i >&2; done', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.equal(out.join(''), '1\n2\n3\n')
  assert.equal(err.join(''), 'e1\ne2\ne3\n')
  assert.equal(r2.stdout, '1\n2\n3\n')
  assert.equal(r2.stderr, 'e1\ne2\ne3\n')
})

test('a non-zero exit rejects with CommandExitError carrying the result', async () => {
  const e = await rejectsWith(sbx.commands.run('echo partial; echo why >&2; exit 3'), CommandExitError)
  assert.ok(e instanceof SandboxError)
  assert.deepEqual({ exitCode: e.exitCode, stdout: e.stdout, stderr: e.stderr, error: e.error }, {
    exitCode: 3,
    stdout: 'partial\n',
    stderr: 'why\n',
    error: 'exit status 3',
  })
})

test('envs lie over the creation envs; cwd and user are passed on', async () => {
  const r = await sbx.commands.run('echo $FROM_CREATE $SHADOWED $ONLY; pwd', {
    envs: { SHADOWED: 'cmd', ONLY: '1' },
    cwd: '/tmp',
  })
  assert.equal(r.stdout, 'made cmd 1\n/tmp\n')
  // Without them: the creation envs and the user's home.
  assert.equal((await sbx.commands.run('echo $FROM_CREATE $SHADOWED; pwd')).stdout, 'made create\n/root\n')
  assert.equal((await sbx.commands.run('id -u; id -un', { user: 'root' })).stdout, '0\nroot\n')
  // Another user of the image (whose home, /nonexistent, is no directory: a cwd is given).
  assert.equal((await sbx.commands.run('id -un; pwd', { user: 'nobody', cwd: '/tmp' })).stdout, 'nobody\n/tmp\n')
  // A user the sandbox's /etc/passwd lacks is refused by name.
  const e = await rejectsWith(sbx.commands.run('true', { user: 'no-such-user' }), InvalidArgumentError)
  assert.match(e.message, /no-such-user/)
  // A working directory that is not there is refused too.
  await rejectsWith(sbx.commands.run('true', { cwd: '/no/such/dir' }), InvalidArgumentError)
})

test('a background command: wait for its result, or its CommandExitError', async () => {
  const h = await sbx.commands.run('echo bg; echo bg-err >&2; exit 0', { background: true })
  assert.equal(typeof h.pid, 'number')
  const r = await h.wait()
  assert.deepEqual({ stdout: r.stdout, stderr: r.stderr, exitCode: r.exitCode }, {
    stdout: 'bg\n',
    stderr: 'bg-err\n',
    exitCode: 0,
  })
  assert.equal(h.exitCode, 0)
  assert.equal(h.stdout, 'bg\n')

  const failing = await sbx.commands.run('echo so far; exit 4', { background: true })
  const e = await rejectsWith(failing.wait(), CommandExitError)
  assert.equal(e.exitCode, 4)
  assert.equal(e.stdout, 'so far\n')
})

test('background commands are listed and killed; killing one gone is false', async () => {
  const h = await sbx.commands.run('touch /tmp/bg.started; exec sleep 300', { background: true })
  await waitUntil('the command to start', () => exists(sbx, '/tmp/bg.started'))
  const listed = (await sbx.commands.list()).find((p) => p.pid === h.pid)
  assert.ok(listed, 'the background command is listed')
  assert.equal(listed.cmd, '/bin/bash')
  assert.deepEqual(listed.args, ['-l', '-c', 'touch /tmp/bg.started; exec sleep 300'])
  assert.equal(await sbx.commands.kill(h.pid), true)
  await waitUntil('the killed command to leave the list', async () => !(await pids(sbx)).includes(h.pid))
  assert.equal(await sbx.commands.kill(h.pid), false)
  const e = await rejectsWith(h.wait(), CommandExitError)
  assert.equal(e.exitCode, -1)
  assert.equal(e.error, 'signal: killed')
  assert.equal((await sbx.commands.run('echo still here')).stdout, 'still here\n')
})

// envd lists each process with the config of its Start request as sent (handler.Config):
// the creation envs are the sandbox's defaults, not the command's, and a cwd not given is none.

/** Starts `cmd` in the background with `opts`, calls `f` with what commands.list says of it,
 * and kills it. */
async function listedAs(cmd, opts, f) {
  const h = await sbx.commands.run(cmd, { background: true, ...opts })
  try {
    const listed = (await sbx.commands.list()).find((p) => p.pid === h.pid)
    assert.ok(listed, `pid ${h.pid} is not listed`)
    assert.equal(listed.cmd, '/bin/bash')
    assert.deepEqual(listed.args, ['-l', '-c', cmd])
    assert.equal(listed.tag, undefined)
    await f(listed)
  } finally {
    await h.kill()
  }
}

// envd lists no cwd for a command that named none; the gateway lists where it runs, the
// user's home here (docs/e2b.md "The in-sandbox API").
test("commands.list shows a command's cwd as given, and where it runs when none was", async () => {
  await listedAs('exec sleep 331', { cwd: '/tmp' }, (p) => assert.equal(p.cwd, '/tmp'))
  await listedAs('exec sleep 332', {}, (p) => assert.equal(p.cwd, '/root'))
})

test("commands.list shows a command's own envs, not the sandbox's", async () => {
  await listedAs('exec sleep 333', { envs: { ONLY: '1' } }, (p) => assert.deepEqual(p.envs, { ONLY: '1' }))
  await listedAs('exec sleep 334', {}, (p) => assert.deepEqual(p.envs, {}))
})

test('an unknown pid is not found for connect, sendStdin and closeStdin', async () => {
  const unknown = 999_999
  await rejectsWith(sbx.commands.connect(unknown), NotFoundError)
  await rejectsWith(sbx.commands.sendStdin(unknown, 'x'), NotFoundError)
  await rejectsWith(sbx.commands.closeStdin(unknown), NotFoundError)
  assert.equal(await sbx.commands.kill(unknown), false)
})

test("a handle's kill ends the whole tree of the command", async () => {
  const h = await sbx.commands.run('sleep 301 & sleep 302 & wait', { background: true })
  await waitUntil('both children', async () => (await sleeps(sbx, '30[12]')) === 2)
  assert.equal(await h.kill(), true)
  await waitUntil('no child left', async () => (await sleeps(sbx, '30[12]')) === 0)
  await rejectsWith(h.wait(), CommandExitError)
})

test('connect(pid) follows a running command from then on', async () => {
  await sbx.commands.run('rm -f /tmp/go.fifo; mkfifo /tmp/go.fifo')
  const h = await sbx.commands.run(
    "read go < /tmp/go.fifo; head -c 8192 /dev/zero | tr '\\0' x; echo; echo end",
    { background: true },
  )
  const seen = []
  const again = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  assert.equal(again.pid, h.pid)
  // It waits on the FIFO: nothing was printed before the connect.
  await sbx.commands.run('echo go > /tmp/go.fifo', { timeoutMs: 10_000 })
  const r = await again.wait()
  assert.equal(r.stdout, 'x'.repeat(8192) + '\nend\n')
  assert.equal(seen.join(''), r.stdout)
  assert.equal(r.exitCode, 0)
})

test('a handle disconnects and the command runs on; connect picks it up again', async () => {
  await sbx.commands.run('rm -f /tmp/go2.fifo; mkfifo /tmp/go2.fifo')
  const h = await sbx.commands.run('read go < /tmp/go2.fifo; echo later', { background: true })
  await h.disconnect()
  assert.ok((await pids(sbx)).includes(h.pid), 'the command runs on after the disconnect')
  const again = await sbx.commands.connect(h.pid)
  await sbx.commands.run('echo go > /tmp/go2.fifo', { timeoutMs: 10_000 })
  const r = await again.wait()
  assert.equal(r.stdout, 'later\n')
  assert.equal(r.exitCode, 0)
})

test('a timeout rejects promptly with TimeoutError and the command is gone', async () => {
  const started = Date.now()
  const e = await rejectsWith(sbx.commands.run('sleep 61', { timeoutMs: 2000 }), TimeoutError)
  const took = Date.now() - started
  assert.ok(took >= 1900 && took < 5000, `rejected after ${took} ms`)
  assert.match(e.message, /deadline_exceeded/)
  await waitUntil('no sleep 61 left', async () => (await sleeps(sbx, '61')) === 0)
  // A background command's timeout ends it the same way.
  const h = await sbx.commands.run('sleep 62', { background: true, timeoutMs: 1000 })
  await rejectsWith(h.wait(), TimeoutError)
  await waitUntil('no sleep 62 left', async () => (await sleeps(sbx, '62')) === 0)
})

test('sendStdin feeds a command; closeStdin ends its input', async () => {
  const h = await sbx.commands.run('cat; echo done', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'line one\n')
  await sbx.commands.sendStdin(h.pid, new TextEncoder().encode('line two\n'))
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'line one\nline two\ndone\n')
  // Through the handle, read line by line.
  const h2 = await sbx.commands.run('read a; read b; echo "$b $a"', { background: true, stdin: true })
  await h2.sendStdin('first\n')
  await h2.sendStdin('second\n')
  assert.equal((await h2.wait()).stdout, 'second first\n')
})

test('a terminal: input, resize and exit', async () => {
  const chunks = []
  const t = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) })
  await sbx.pty.sendInput(t.pid, new TextEncoder().encode('echo $((6*7))\n'))
  await sbx.pty.resize(t.pid, { cols: 100, rows: 30 })
  await sbx.pty.sendInput(t.pid, new TextEncoder().encode('stty size; exit\n'))
  const r = await t.wait()
  assert.equal(r.exitCode, 0)
  const text = Buffer.concat(chunks).toString()
  assert.ok(text.includes('42\r\n'), JSON.stringify(text))
  assert.ok(text.includes('30 100\r\n'), JSON.stringify(text))

  // A terminal is killed like a command.
  const t2 = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {} })
  assert.ok((await pids(sbx)).includes(t2.pid))
  assert.equal(await sbx.pty.kill(t2.pid), true)
  const e = await rejectsWith(t2.wait(), CommandExitError)
  assert.equal(e.error, 'signal: killed')
  await waitUntil('the terminal to leave the list', async () => !(await pids(sbx)).includes(t2.pid))
  assert.equal(await sbx.pty.kill(t2.pid), false)
})
