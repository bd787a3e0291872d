// `tandem serve` through the official OpenAI client: chat and completions, streamed and not,
// stop strings, seeds, logprobs, usage.speculation consistent with the tokens returned.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { startServer, generateAlone } from './harness.mjs';

let server, client;
const model = 'qwen35-demo';
const code = 'def read_config(path):\n    """Read a JSON configuration file."""\n';

before(async () => {
  server = await startServer(['--draft', 'mtp', '--depth', '3', '--max-batch', '8']);
  client = new OpenAI({ baseURL: server.url + '/v1', apiKey: 'unused', maxRetries: 0 });
});
after(async () => {
  const { code: exitCode } = await server.stop();
  assert.equal(exitCode, 0, 'server exits cleanly on SIGTERM');
});

// usage.speculation must add up: every round emits its accepted proposals plus one token, the
// prefill emits one more; positions count what was accepted at each window slot.
function checkSpeculation(usage, finishReason) {
  const s = usage.speculation;
  assert.equal(s.draft, 'mtp');
  assert.equal(s.depth, 3);
  assert.equal(s.accepted_by_position.length, 3);
  assert.equal(s.accepted_by_position.reduce((a, b) => a + b, 0), s.accepted);
  assert.ok(s.accepted <= s.drafted);
  for (let j = 1; j < 3; ++j) assert.ok(s.accepted_by_position[j] <= s.accepted_by_position[j - 1]);
  if (s.rounds > 0) assert.ok(Math.abs(s.mean_accepted_length - (s.accepted + s.rounds) / s.rounds) < 1e-9);
  if (finishReason === 'length') assert.equal(usage.completion_tokens, 1 + s.rounds + s.accepted);
  else assert.ok(usage.completion_tokens <= 1 + s.rounds + s.accepted);
  assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
}

test('models lists the served model', async () => {
  const list = await client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), [model]);
});

test('chat completion equals tandem generate of the templated prompt', async () => {
  const r = await client.chat.completions.create({
    model, messages: [{ role: 'system', content: 'You write Python.' }, { role: 'user', content: code }],
    max_tokens: 40, temperature: 0.7, top_p: 0.9, seed: 11, return_token_ids: true,
  });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  const want = await generateAlone({ promptIds: r.prompt_token_ids, maxTokens: 40, temperature: 0.7, topP: 0.9, seed: 11 });
  assert.deepEqual(r.choices[0].token_ids, want.tokens);
  assert.equal(r.choices[0].finish_reason, want.finish_reason);
  assert.equal(r.usage.prompt_tokens, r.prompt_token_ids.length);
  checkSpeculation(r.usage, r.choices[0].finish_reason);
});

test('streamed chat equals the whole response, with a usage chunk', async () => {
  const args = { model, messages: [{ role: 'user', content: code }], max_tokens: 30, temperature: 0.8, seed: 5 };
  const whole = await client.chat.completions.create(args);
  const stream = await client.chat.completions.create({ ...args, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, role = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta.role) role = c.delta.role;
      text += c.delta.content ?? '';
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.equal(role, 'assistant');
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, whole.choices[0].finish_reason);
  assert.ok(usage, 'include_usage sends a usage chunk');
  assert.equal(usage.completion_tokens, whole.usage.completion_tokens);
  checkSpeculation(usage, finish);
});

test('completions, streamed and not, equal tandem generate', async () => {
  const r = await client.completions.create({ model, prompt: code, max_tokens: 25, temperature: 0, return_token_ids: true });
  assert.equal(r.object, 'text_completion');
  const want = await generateAlone({ promptIds: r.prompt_token_ids, maxTokens: 25 });
  assert.deepEqual(r.choices[0].token_ids, want.tokens);
  assert.equal(r.choices[0].text, want.text.replaceAll('<|endoftext|>', ''));
  checkSpeculation(r.usage, r.choices[0].finish_reason);
  const stream = await client.completions.create({ model, prompt: code, max_tokens: 25, temperature: 0, stream: true });
  let text = '';
  for await (const chunk of stream) for (const c of chunk.choices) text += c.text;
  assert.equal(text, r.choices[0].text);
});

test('token-id prompts work without text', async () => {
  const ids = [326, 1439, 2205, 1810, 963];
  const r = await client.completions.create({ model, prompt: ids, max_tokens: 12, temperature: 0, return_token_ids: true });
  assert.deepEqual(r.prompt_token_ids, ids);
  assert.deepEqual(r.choices[0].token_ids, (await generateAlone({ promptIds: ids, maxTokens: 12 })).tokens);
});

test('stop strings cut the text before the first match and finish with stop', async () => {
  const base = { model, prompt: code, max_tokens: 60, temperature: 0 };
  const full = (await client.completions.create(base)).choices[0].text;
  // A stop string taken from the middle of the unstopped text.
  const at = Math.floor(full.length / 2);
  const stop = full.slice(at, at + 3);
  assert.ok(stop.length === 3 && full.indexOf(stop) >= 0);
  for (const stream of [false, true]) {
    let text = '', finish;
    if (stream) {
      const s = await client.completions.create({ ...base, stop: [stop, 'zzzz-never'], stream: true });
      for await (const chunk of s) for (const c of chunk.choices) { text += c.text; finish = c.finish_reason ?? finish; }
    } else {
      const r = await client.completions.create({ ...base, stop: [stop, 'zzzz-never'] });
      text = r.choices[0].text;
      finish = r.choices[0].finish_reason;
    }
    assert.equal(text, full.slice(0, full.indexOf(stop)), `stream=${stream}`);
    assert.equal(finish, 'stop');
  }
});

test('seeds: same seed, same text; another seed, another text', async () => {
  const args = { model, messages: [{ role: 'user', content: code }], max_tokens: 40, temperature: 1.0 };
  const a = await client.chat.completions.create({ ...args, seed: 1 });
  const b = await client.chat.completions.create({ ...args, seed: 1 });
  const c = await client.chat.completions.create({ ...args, seed: 2 });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.notEqual(a.choices[0].message.content, c.choices[0].message.content);
});

test('logprobs: the chosen token leads its greedy top list', async () => {
  const r = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: code }], max_tokens: 10, temperature: 0, logprobs: true, top_logprobs: 3,
  });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, r.usage.completion_tokens);
  for (const t of content) {
    assert.equal(t.top_logprobs.length, 3);
    assert.equal(t.top_logprobs[0].token, t.token);
    assert.ok(t.logprob <= 0);
    assert.ok(t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob);
  }
});

test('client errors come back as OpenAI errors', async () => {
  await assert.rejects(client.chat.completions.create({ model: 'gpt-nope', messages: [{ role: 'user', content: 'x' }] }),
                       (e) => e.status === 404 && /does not exist/.test(e.message));
  await assert.rejects(client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], temperature: 7 }),
                       (e) => e.status === 400 && e.param === 'temperature');
});
