// Command line: node dist/complete.js ADDRESS MODEL TENSOR.f32 ROWS HIDDEN [MAX_TOKENS]
// Streams the completion of a raw float32 (rows, hidden) tensor file and prints {"text", "usage"} as JSON.
// MODEL is any id models.js lists: a base model or a loaded LoRA adapter's name.
import { readFileSync } from "node:fs";
import { EmbedmeshClient, float32Tensor } from "./client.js";

const [address, model, file, rows, hidden, maxTokens] = process.argv.slice(2);
if (!address || !model || !file || !rows || !hidden) {
  console.error("usage: complete.js ADDRESS MODEL TENSOR.f32 ROWS HIDDEN [MAX_TOKENS]");
  process.exit(2);
}
const bytes = readFileSync(file);
const values = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
const client = new EmbedmeshClient(address);
try {
  const deltas: string[] = [];
  const result = await client.streamComplete(
    model,
    float32Tensor(values, Number(rows), Number(hidden)),
    { maxTokens: Number(maxTokens ?? 12), temperature: 0 },
    (d) => deltas.push(d.text),
  );
  console.log(JSON.stringify({ text: result.text[0], deltas: deltas.length, finish: result.finishReasons[0],
                               usage: result.usage }));
} catch (err: any) {
  console.error(JSON.stringify({ code: err.code, details: err.details }));
  process.exitCode = 1;
} finally {
  client.close();
}
