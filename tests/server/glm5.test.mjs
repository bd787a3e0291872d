// `tandem serve` with a GLM-5 target (the bundled GLM-5 demo and its NextN drafter): concurrent
// clients at several temperatures each get exactly what `tandem generate` alone gives, also when
// a later request restores an earlier one's prefix from the prefix cache.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, generateAlone, postJson, metrics, sleep, sourceDir, glmDemoModel } from './harness.mjs';

const prompts = fs.readFileSync(path.join(sourceDir, 'models/glm5-demo/prompts.jsonl'), 'utf8')
  .split('\n').filter(Boolean).map((l) => JSON.parse(l).prompt);

test('GLM-5: concurrent clients and prefix-cache hits equal tandem generate alone', async () => {
  const server = await startServer(['--draft', 'mtp', '--depth', '3', '--max-batch', '4',
                                    '--prefill-chunk', '16'], glmDemoModel);
  try {
    const run = async (i, prompt) => {
      const body = { model: 'glm5-demo', prompt, max_tokens: 12 + (i * 5) % 20, temperature: [0, 0.7, 1.0][i % 3],
                     seed: 500 + i, return_token_ids: true };
      await sleep(i * 30);
      const r = await postJson(server.url, '/v1/completions', body);
      assert.equal(r.status, 200, r.text);
      return { body, ids: r.json.choices[0].token_ids, promptIds: r.json.prompt_token_ids };
    };
    const first = await Promise.all(prompts.slice(0, 6).map((p, i) => run(i, p)));
    // The same prompts with another ending: each restores its prefix at the grid's boundary.
    const second = await Promise.all(prompts.slice(0, 6).map((p, i) => run(i + 6, p + '    # again\n')));
    for (const r of [...first, ...second]) {
      const want = await generateAlone({ promptIds: r.promptIds, maxTokens: r.body.max_tokens,
                                         temperature: r.body.temperature, seed: r.body.seed, model: glmDemoModel });
      assert.deepEqual(r.ids, want.tokens, `prompt ${JSON.stringify(r.body.prompt.slice(0, 40))}`);
    }
    const m = await metrics(server.url);
    assert.ok(m['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'] >= 6, JSON.stringify(m));
  } finally {
    const { code } = await server.stop();
    assert.equal(code, 0, server.log());
  }
});
