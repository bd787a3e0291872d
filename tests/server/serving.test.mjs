// `tandem serve` under load and abuse: 32+ staggered concurrent clients each get exactly what
// `tandem generate` alone gives; malformed requests get their status and message while the
// server keeps serving; overload is refused with 503 and recovers; a client that hangs up frees
// its row; /metrics agrees with what happened; SIGTERM shuts down cleanly.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, generateAlone, postJson, metrics, sleep, readEvents, sourceDir } from './harness.mjs';

const model = 'qwen35-demo';
const prompts = fs.readFileSync(path.join(sourceDir, 'models/qwen35-demo/prompts.jsonl'), 'utf8')
  .split('\n').filter(Boolean).map((l) => JSON.parse(l).prompt);
const longPrompt = fs.readFileSync(path.join(sourceDir, 'models/qwen35-demo/heldout_sample.py'), 'utf8').slice(0, 2400);

test('exactness under load: 36 staggered concurrent clients equal tandem generate alone', async () => {
  const server = await startServer(['--draft', 'mtp', '--depth', '3', '--max-batch', '8', '--prefill-budget', '256']);
  try {
    const jobs = [];
    for (let i = 0; i < 36; ++i) {
      const temperature = [0, 0.7, 1.0][i % 3];
      const body = {
        model,
        prompt: i % 9 === 4 ? longPrompt : prompts[i % prompts.length] + (i >= 8 ? `    # variant ${i}\n` : ''),
        max_tokens: 8 + (i * 7) % 40,
        temperature,
        top_p: i % 2 ? 0.9 : 1.0,
        top_k: i % 4 === 1 ? 20 : 0,
        seed: 1000 + i,
        stream: i % 2 === 0,
        return_token_ids: true,
      };
      jobs.push((async () => {
        await sleep(i * 40);  // staggered arrivals: clients join a running batch
        if (!body.stream) {
          const r = await postJson(server.url, '/v1/completions', body);
          assert.equal(r.status, 200, r.text);
          return { body, ids: r.json.choices[0].token_ids, promptIds: r.json.prompt_token_ids,
                   finish: r.json.choices[0].finish_reason };
        }
        const res = await fetch(server.url + '/v1/completions', {
          method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
        assert.equal(res.status, 200);
        const events = await readEvents(res);
        assert.equal(events.at(-1), '[DONE]');
        let ids = [], promptIds = null, finish = null;
        for (const e of events.slice(0, -1)) {
          if (e.prompt_token_ids) promptIds = e.prompt_token_ids;
          for (const c of e.choices) {
            ids = ids.concat(c.token_ids ?? []);
            finish = c.finish_reason ?? finish;
          }
        }
        return { body, ids, promptIds, finish };
      })());
    }
    const results = await Promise.all(jobs);
    for (const [i, r] of results.entries()) {
      const want = await generateAlone({ promptIds: r.promptIds, maxTokens: r.body.max_tokens, temperature: r.body.temperature,
                                   topP: r.body.top_p, topK: r.body.top_k, seed: r.body.seed });
      assert.deepEqual(r.ids, want.tokens, `client ${i}`);
      assert.equal(r.finish, want.finish_reason, `client ${i}`);
    }
    assert.ok(results.some((r) => r.promptIds.length > 512), 'one prompt spans several prefill chunks');
    const m = await metrics(server.url);
    assert.equal(m['tandem_requests_total{outcome="ok"}'], 36);
    assert.equal(m['tandem_kv_blocks_used'], m['tandem_prefix_cache_kv_blocks'], 'only the prefix cache holds blocks');
    assert.equal(m['tandem_running_rows{phase="decode"}'], 0);
    assert.equal(m['tandem_cold_graph_runs_total'], 0, 'the CPU runs no CUDA graphs');
    assert.equal(m['tandem_graph_evictions_total'], 0, 'nor evicts any');
    const generated = results.reduce((a, r) => a + r.ids.length, 0);
    assert.equal(m['tandem_generation_tokens_total'], generated);
    assert.equal(m['tandem_time_to_first_token_seconds_count'], 36);
    assert.equal(m['tandem_inter_token_latency_seconds_count'], generated - 36);
    let drafted = 0, accepted = 0;
    for (let j = 0; j < 3; ++j) {
      drafted += m[`tandem_draft_tokens_total{drafter="mtp",position="${j}"}`];
      accepted += m[`tandem_accepted_tokens_total{drafter="mtp",position="${j}"}`];
    }
    assert.ok(drafted > 0 && accepted > 0 && accepted <= drafted);
    for (const phase of ['draft', 'verify', 'accept', 'commit'])
      assert.ok(m[`tandem_round_phase_seconds_total{phase="${phase}"}`] > 0, `${phase} time counted`);
  } finally {
    assert.equal((await server.stop()).code, 0);
  }
});

test('malformed requests: each gets its status and message; the server keeps serving', async () => {
  const server = await startServer(['--draft', 'ngram', '--max-batch', '4']);
  const chat = (extra) => ({ model, messages: [{ role: 'user', content: 'def f():' }], max_tokens: 4, ...extra });
  const cases = [
    ['/v1/chat/completions', '{"model": "qwen35-demo", "messages": [', 400, /not valid JSON/],
    ['/v1/chat/completions', '[1, 2]', 400, /must be a JSON object/],
    // Invalid UTF-8 inside a JSON string: {"model":"\xff"}
    ['/v1/chat/completions', Buffer.from([0x7b, 0x22, 0x6d, 0x6f, 0x64, 0x65, 0x6c, 0x22, 0x3a, 0x22, 0xff, 0x22, 0x7d]),
     400, /not valid JSON/],
    ['/v1/chat/completions', { messages: [{ role: 'user', content: 'x' }] }, 400, /provide a model/],
    ['/v1/chat/completions', { model: 3, messages: [] }, 400, /'model' must be a string/],
    ['/v1/chat/completions', chat({ model: 'other' }), 404, /does not exist/],
    ['/v1/chat/completions', { model }, 400, /'messages' is required/],
    ['/v1/chat/completions', { model, messages: [] }, 400, /must not be empty/],
    ['/v1/chat/completions', { model, messages: 'hi' }, 400, /must be an array/],
    ['/v1/chat/completions', { model, messages: [{ role: 'wizard', content: 'x' }] }, 400, /role' is 'wizard'/],
    ['/v1/chat/completions', { model, messages: [{ role: 'user', content: 5 }] }, 400, /content' must be a string/],
    ['/v1/chat/completions', { model, messages: [{ role: 'user' }] }, 400, /content' is required/],
    ['/v1/chat/completions', { model, messages: ['x'] }, 400, /must be an object/],
    ['/v1/chat/completions', chat({ temperature: 'hot' }), 400, /'temperature' must be a number/],
    ['/v1/chat/completions', chat({ temperature: 5 }), 400, /'temperature' must be in/],
    ['/v1/chat/completions', chat({ top_p: 0 }), 400, /'top_p' must be greater than 0/],
    ['/v1/chat/completions', chat({ max_tokens: 0 }), 400, /'max_tokens' must be an integer/],
    ['/v1/chat/completions', chat({ max_tokens: 2.5 }), 400, /'max_tokens' must be an integer/],
    ['/v1/chat/completions', chat({ n: 2 }), 400, /only 'n': 1/],
    ['/v1/chat/completions', chat({ stop: ['a', 'b', 'c', 'd', 'e'] }), 400, /at most 4/],
    ['/v1/chat/completions', chat({ stop: '' }), 400, /must not be empty/],
    ['/v1/chat/completions', chat({ stop: [1] }), 400, /'stop' must be a string/],
    ['/v1/chat/completions', chat({ logprobs: true, top_logprobs: 25 }), 400, /'top_logprobs' must be an integer/],
    ['/v1/chat/completions', chat({ top_logprobs: 2 }), 400, /needs 'logprobs': true/],
    ['/v1/chat/completions', chat({ stream_options: { include_usage: true } }), 400, /needs 'stream': true/],
    ['/v1/chat/completions', chat({ stream: 'yes' }), 400, /'stream' must be a boolean/],
    ['/v1/chat/completions', chat({ presence_penalty: 1 }), 400, /not supported/],
    ['/v1/chat/completions', chat({ seed: 'abc' }), 400, /'seed' must be an integer/],
    ['/v1/completions', { model, prompt: Array(5000).fill(7) }, 400, /context is 4096/],
    ['/v1/completions', { model, prompt: [1, 2, 99999] }, 400, /out of range/],
    ['/v1/completions', { model, prompt: 'x', max_tokens: 4096 }, 400, /exceed the model's context/],
    ['/v1/completions', { model, prompt: '' }, 400, /must not be empty/],
    ['/v1/completions', { model, prompt: ['a', 'b'] }, 400, /one prompt per request/],
    ['/v1/completions', { model, prompt: { text: 'x' } }, 400, /'prompt' must be/],
    ['/v1/completions', { model, prompt: 'x', suffix: 'y' }, 400, /'suffix' is not supported/],
  ];
  const before = await metrics(server.url);
  let invalid = 0;
  try {
    for (const [route, body, status, message] of cases) {
      const r = await postJson(server.url, route, body);
      assert.equal(r.status, status, `${JSON.stringify(body)} -> ${r.text}`);
      assert.ok(r.json && r.json.error, `OpenAI error shape for ${JSON.stringify(body)}`);
      assert.match(r.json.error.message, message, JSON.stringify(body));
      assert.equal(typeof r.json.error.type, 'string');
      ++invalid;
      // Still serving after every one of them.
      if (invalid % 7 === 0) {
        const ok = await postJson(server.url, '/v1/completions', { model, prompt: 'def f():', max_tokens: 3 });
        assert.equal(ok.status, 200);
      }
    }
    // Not generation requests: routes and body size.
    const big = await postJson(server.url, '/v1/completions', { model, prompt: 'x'.repeat(9 << 20) });
    assert.equal(big.status, 413);
    assert.match(big.json.error.message, /too large/);
    const nope = await fetch(server.url + '/v1/nothing');
    assert.equal(nope.status, 404);
    assert.match((await nope.json()).error.message, /no route/);
    const m = await metrics(server.url);
    assert.equal(m['tandem_requests_total{outcome="invalid"}'] - before['tandem_requests_total{outcome="invalid"}'], invalid);
    assert.equal(m['tandem_requests_total{outcome="ok"}'], Math.floor(invalid / 7));
    assert.equal(m['tandem_running_rows{phase="decode"}'] + m['tandem_running_rows{phase="prefill"}'], 0);
  } finally {
    assert.equal((await server.stop()).code, 0);
  }
});

test('api key: every route but /health needs it', async () => {
  const server = await startServer(['--api-key', 'sekrit']);
  try {
    assert.equal((await fetch(server.url + '/health')).status, 200);
    const denied = await postJson(server.url, '/v1/completions', { model, prompt: 'x', max_tokens: 2 });
    assert.equal(denied.status, 401);
    assert.equal(denied.json.error.code, 'invalid_api_key');
    assert.equal((await fetch(server.url + '/v1/models')).status, 401);
    assert.equal((await fetch(server.url + '/metrics')).status, 401);
    const wrong = await postJson(server.url, '/v1/completions', { model, prompt: 'x', max_tokens: 2 },
                                 { authorization: 'Bearer nope' });
    assert.equal(wrong.status, 401);
    const ok = await postJson(server.url, '/v1/completions', { model, prompt: 'x', max_tokens: 2 },
                              { authorization: 'Bearer sekrit' });
    assert.equal(ok.status, 200);
  } finally {
    await server.stop();
  }
});

test('overload: a full queue answers 503, then the server recovers', async () => {
  const server = await startServer(['--max-batch', '1', '--max-queue', '1']);
  try {
    const long = { model, prompt: 'def f():', max_tokens: 1500, ignore_eos: true, temperature: 0 };
    const first = postJson(server.url, '/v1/completions', long);
    await sleep(300);  // running
    const second = postJson(server.url, '/v1/completions', { ...long, max_tokens: 5 });
    await sleep(100);  // queued
    const third = await postJson(server.url, '/v1/completions', { ...long, max_tokens: 5 });
    assert.equal(third.status, 503, third.text);
    assert.match(third.json.error.message, /overloaded/);
    assert.equal((await first).status, 200);
    assert.equal((await second).status, 200);
    const again = await postJson(server.url, '/v1/completions', { ...long, max_tokens: 5 });
    assert.equal(again.status, 200);
    const m = await metrics(server.url);
    assert.equal(m['tandem_requests_total{outcome="overloaded"}'], 1);
    assert.equal(m['tandem_requests_total{outcome="ok"}'], 3);
  } finally {
    await server.stop();
  }
});

test('a client that hangs up mid-stream frees its row; neighbours are unaffected', async () => {
  const server = await startServer(['--draft', 'mtp', '--max-batch', '4']);
  try {
    const neighbour = { model, prompt: prompts[0], max_tokens: 60, temperature: 0.7, seed: 9, return_token_ids: true };
    const n = postJson(server.url, '/v1/completions', neighbour);
    const ctrl = new AbortController();
    const res = await fetch(server.url + '/v1/completions', {
      method: 'POST', headers: { 'content-type': 'application/json' }, signal: ctrl.signal,
      body: JSON.stringify({ model, prompt: prompts[1], max_tokens: 3000, ignore_eos: true, stream: true }),
    });
    let seen = 0;
    try {
      await readEvents(res, () => ++seen < 4);
    } finally {
      ctrl.abort();
    }
    // Freed within a round or so: poll briefly.
    let m;
    for (let i = 0; i < 50; ++i) {
      m = await metrics(server.url);
      if (m['tandem_requests_total{outcome="cancelled"}'] === 1) break;
      await sleep(100);
    }
    assert.equal(m['tandem_requests_total{outcome="cancelled"}'], 1);
    const r = await n;
    assert.equal(r.status, 200);
    const want = await generateAlone({ promptIds: r.json.prompt_token_ids, maxTokens: 60, temperature: 0.7, seed: 9 });
    assert.deepEqual(r.json.choices[0].token_ids, want.tokens);
    m = await metrics(server.url);
    assert.equal(m['tandem_running_rows{phase="decode"}'], 0);
    assert.equal(m['tandem_kv_blocks_used'], m['tandem_prefix_cache_kv_blocks'], 'only the prefix cache holds blocks');
  } finally {
    await server.stop();
  }
});

test('SIGTERM ends in-flight requests with an error and exits 0', async () => {
  const server = await startServer(['--max-batch', '2']);
  const res = await fetch(server.url + '/v1/completions', {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model, prompt: 'def f():', max_tokens: 3000, ignore_eos: true, stream: true }),
  });
  let signalled = false;
  const events = await readEvents(res, (e) => {
    if (!signalled) {
      signalled = true;
      server.proc.kill('SIGTERM');
    }
    return true;
  });
  assert.equal(events.at(-1), '[DONE]');
  assert.ok(events.some((e) => e.error && /shutting down/.test(e.error.message)));
  const { code } = await server.exited;
  assert.equal(code, 0);
});
