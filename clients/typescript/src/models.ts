// Command line: node dist/models.js ADDRESS
// Prints the mesh's ListModels result as JSON: {"models": [{id, parent, hiddenSize, ...}]}; a LoRA adapter is a
// model whose parent is its base model. Errors go to stderr as {"code", "details"} with exit code 1.
import { EmbedmeshClient } from "./client.js";

const [address] = process.argv.slice(2);
if (!address) {
  console.error("usage: models.js ADDRESS");
  process.exit(2);
}
const client = new EmbedmeshClient(address);
try {
  const models = await client.listModels();
  console.log(JSON.stringify({ models }));
} catch (err: any) {
  console.error(JSON.stringify({ code: err.code, details: err.details }));
  process.exitCode = 1;
} finally {
  client.close();
}
