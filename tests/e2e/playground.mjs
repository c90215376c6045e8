// Drives the gateway's playground in headless Chromium, as a person would:
//   1. upload an image, paint a stroke on the mask, type a prompt, submit, wait for the result;
//   2. tick "register it as a template", submit again (capture, then an edit by template_id);
//   3. reload, pick the registered template from the list (its image comes from the API),
//      paint, submit, wait for the result.
// Prints one JSON line with what it saw; exits 0 only when every edit finished with a result.
// Run by tests/tests/playground.rs, which starts the mesh and checks the results through the API.
//
// node playground.mjs --url URL --image PNG --chromium PATH --out DIR [--screenshot PNG] [--steps N]
//   [--api-key KEY]
import { writeFileSync, mkdirSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

function args() {
  const out = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || argv[i + 1] === undefined) {
      throw new Error(`bad argument ${argv[i]}: expected --name value pairs`);
    }
    out[argv[i].slice(2)] = argv[i + 1];
  }
  for (const name of ["url", "image", "chromium", "out"]) {
    if (!out[name]) throw new Error(`--${name} is required`);
  }
  return out;
}

const EDIT_TIMEOUT_MS = 150_000;

/** Paint a stroke from (fx0, fy0) to (fx1, fy1), fractions of the mask canvas. */
async function paint(page, [fx0, fy0], [fx1, fy1]) {
  const box = await page.locator("#mask-canvas").boundingBox();
  if (!box || box.width < 10) throw new Error(`the mask canvas is not laid out: ${JSON.stringify(box)}`);
  await page.mouse.move(box.x + fx0 * box.width, box.y + fy0 * box.height);
  await page.mouse.down();
  await page.mouse.move(box.x + fx1 * box.width, box.y + fy1 * box.height, { steps: 12 });
  await page.mouse.up();
}

/** Click Edit and wait for the job's ending; returns what the page shows. */
async function submitAndWait(page) {
  await page.click("#submit");
  await page.waitForSelector('#status[data-state="done"], #status[data-state="failed"]', {
    timeout: EDIT_TIMEOUT_MS,
  });
  return page.evaluate(() => {
    const result = document.getElementById("result");
    const figure = document.getElementById("result-figure");
    return {
      state: document.getElementById("status").dataset.state,
      status: document.getElementById("status").textContent,
      events: [...document.querySelectorAll("#events li")].map((li) => li.textContent),
      // The page folds step events into one line, counting them.
      stepEvents: [...document.querySelectorAll("#events li[data-steps]")].map((li) => Number(li.dataset.steps)),
      jobId: result.dataset.jobId || null,
      resultShown: !figure.hidden && result.complete && result.naturalWidth > 0,
      resultWidth: result.naturalWidth,
      resultHeight: result.naturalHeight,
      // Previews the page showed while the job ran (`preview` events).
      previews: Number(document.getElementById("preview-figure").dataset.count || 0),
      mask: document.getElementById("sent-mask").src,
      source: document.querySelector('input[name="source"]:checked').value,
      templateId: document.getElementById("template-select").value || null,
    };
  });
}

function saveMask(dataUrl, path) {
  const prefix = "data:image/png;base64,";
  if (!dataUrl.startsWith(prefix)) throw new Error("the page shows no mask it sent");
  writeFileSync(path, Buffer.from(dataUrl.slice(prefix.length), "base64"));
}

async function main() {
  const opt = args();
  mkdirSync(opt.out, { recursive: true });
  const browser = await chromium.launch({
    executablePath: opt.chromium,
    headless: true,
    // Root in a container has no user namespace for Chromium's sandbox.
    args: ["--no-sandbox", "--disable-dev-shm-usage"],
  });
  const problems = [];
  const edits = [];
  try {
    const page = await browser.newPage({ viewport: { width: 1360, height: 820 } });
    page.on("pageerror", (err) => problems.push(`page error: ${err.message}`));
    page.on("console", (msg) => {
      if (msg.type() === "error") problems.push(`console error: ${msg.text()}`);
    });
    await page.goto(opt.url, { waitUntil: "load" });
    await page.waitForSelector("#submit");
    if (opt["api-key"]) {
      // The gateway has keys configured: the page asks for one from the start.
      await page.waitForSelector("#auth-box:not([hidden])", { timeout: 5000 });
      await page.fill("#api-key", opt["api-key"]);
    }

    // 1. Upload, paint, prompt, submit.
    await page.setInputFiles("#image-file", opt.image);
    await page.waitForSelector("#stage:not(.empty)");
    await page.locator("#brush").fill("40");
    await paint(page, [0.55, 0.25], [0.85, 0.7]);
    await page.fill("#prompt", "a yellow square on the right on a blue background");
    await page.click("details summary");
    await page.fill("#seed", "7");
    if (opt.steps) await page.fill("#steps", opt.steps);
    const upload = await submitAndWait(page);
    saveMask(upload.mask, join(opt.out, "mask-upload.png"));
    edits.push({ name: "upload", ...upload, mask: "mask-upload.png" });
    if (opt.screenshot) await page.screenshot({ path: opt.screenshot, fullPage: true });
    if (upload.state !== "done") throw new Error(`upload edit: ${upload.status}`);
    // The download in another format: the browser re-encodes the PNG result.
    await page.selectOption("#download-format", "image/jpeg");
    await page.waitForSelector('#download[data-type="image/jpeg"]', { timeout: 10000 });
    edits[0].download = await page.evaluate(() => {
      const a = document.getElementById("download");
      return { name: a.download, type: a.dataset.type, blob: a.href.startsWith("blob:") };
    });

    // 2. The same image registered as a template, then edited by template_id.
    await page.check("#register");
    const registered = await submitAndWait(page);
    saveMask(registered.mask, join(opt.out, "mask-registered.png"));
    edits.push({ name: "registered", ...registered, mask: "mask-registered.png" });
    if (registered.state !== "done") throw new Error(`register + edit: ${registered.status}`);

    // 3. A fresh page: pick the template from the list, paint elsewhere, submit.
    await page.reload({ waitUntil: "load" });
    await page.check("#source-template");
    await page.waitForSelector("#stage:not(.empty)");
    await paint(page, [0.1, 0.8], [0.4, 0.85]);
    await page.fill("#prompt", "a red circle on the left on a blue background");
    const picked = await submitAndWait(page);
    saveMask(picked.mask, join(opt.out, "mask-picked.png"));
    edits.push({ name: "picked", ...picked, mask: "mask-picked.png" });
    await page.screenshot({ path: join(opt.out, "playground-template.png"), fullPage: true });
    if (picked.state !== "done") throw new Error(`picked template edit: ${picked.status}`);
  } catch (err) {
    problems.push(err.message);
  } finally {
    await browser.close();
  }
  console.log(JSON.stringify({ ok: problems.length === 0, problems, edits }));
  process.exitCode = problems.length === 0 ? 0 : 1;
}

main().catch((err) => {
  console.log(JSON.stringify({ ok: false, problems: [String(err && err.stack ? err.stack : err)], edits: [] }));
  process.exitCode = 1;
});
