// `tandem serve` drafting with the bundled EAGLE-3 head (models/qwen35-demo-eagle3) on the demo
// model: concurrent clients at several temperatures each get exactly what `tandem generate` alone
// gives without a drafter, also when a later request restores an earlier one's prefix from the
// prefix cache; and the head's proposals are accepted under the server (a head that silently drew
// nothing acceptable would pass the equality checks alone).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { startServer, generateAlone, postJson, metrics, sleep, sourceDir } from './harness.mjs';

const head = path.join(sourceDir, 'models', 'qwen35-demo-eagle3');
const prompts = fs.readFileSync(path.join(sourceDir, 'models/qwen35-demo/prompts.jsonl'), 'utf8')
  .split('\n').filter(Boolean).map((l) => JSON.parse(l).prompt);

test('EAGLE-3: concurrent clients and prefix-cache hits equal plain tandem generate alone', async () => {
  const server = await startServer(['--draft', 'eagle3', '--draft-model', head, '--depth', '3',
                                    '--max-batch', '4', '--prefill-chunk', '16']);
  try {
    const run = async (i, prompt) => {
      const body = { model: 'qwen35-demo', prompt, max_tokens: 16 + (i * 7) % 24,
                     temperature: [0, 0.7, 1.0][i % 3], seed: 900 + i, return_token_ids: true };
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
                                         temperature: r.body.temperature, seed: r.body.seed });
      assert.deepEqual(r.ids, want.tokens, `prompt ${JSON.stringify(r.body.prompt.slice(0, 40))}`);
    }
    const m = await metrics(server.url);
    const count = (name) => Object.entries(m).filter(([k]) => k.startsWith(name + '{drafter="eagle3"'))
      .reduce((s, [, v]) => s + v, 0);
    const drafted = count('tandem_draft_tokens_total'), accepted = count('tandem_accepted_tokens_total');
    assert.ok(drafted > 0, JSON.stringify(m));
    // The head accepts ~80% of its first proposals on this model; a quarter is far below that.
    assert.ok(accepted > 0.25 * drafted, `accepted ${accepted} of ${drafted} proposals`);
    assert.ok(m['tandem_prefix_cache_requests_total{tier="memory",result="hit"}'] >= 6, JSON.stringify(m));
  } finally {
    const { code } = await server.stop();
    assert.equal(code, 0, server.log());
  }
});
