
"use strict";
// The diffmesh playground. Plain JavaScript against the public API only:
//   GET  /v1/templates, GET /v1/templates/{id}/image, POST /v1/templates
//   POST /v1/images/edits with `Prefer: respond-async` -> 202 and the job
//   GET  /v1/jobs/{id}/events (Server-Sent Events, read with fetch so the API key header
//        can ride along, which EventSource cannot do), GET the result, DELETE to cancel.
(() => {
  const $ = (id) => document.getElementById(id);
  const el = {
    authBox: $("auth-box"), apiKey: $("api-key"),
    sourceUpload: $("source-upload"), sourceTemplate: $("source-template"),
    uploadBox: $("upload-box"), templateBox: $("template-box"),
    file: $("image-file"), register: $("register"),
    templateSelect: $("template-select"), refreshTemplates: $("refresh-templates"),
    brush: $("brush"), brushValue: $("brush-value"), clearMask: $("clear-mask"),
    prompt: $("prompt"), steps: $("steps"), seed: $("seed"), trueCfg: $("true-cfg"),
    previewEvery: $("preview-every"), previewFigure: $("preview-figure"), preview: $("preview"),
    previewInfo: $("preview-info"), downloadFormat: $("download-format"),
    submit: $("submit"), cancel: $("cancel"),
    stage: $("stage"), layers: $("layers"), imageCanvas: $("image-canvas"),
    maskCanvas: $("mask-canvas"), stageHint: $("stage-hint"), imageInfo: $("image-info"),
    status: $("status"), progress: $("progress"), events: $("events"),
    resultFigure: $("result-figure"), result: $("result"), resultInfo: $("result-info"),
    download: $("download"), maskFigure: $("mask-figure"), sentMask: $("sent-mask"),
  };
  const imageCtx = el.imageCanvas.getContext("2d");
  const maskCtx = el.maskCanvas.getContext("2d");

  const state = {
    file: null,          // the uploaded File (source "upload")
    template: null,      // the picked TemplateView (source "template")
    templates: [],       // GET /v1/templates data
    loaded: false,       // an image is on the canvas
    painting: false,
    last: null,          // last brush point, canvas pixels
    job: null,           // the running JobView
    abort: null,         // AbortController of the event stream
    busy: false,
    resultUrl: null,
    downloadUrl: null,   // the result re-encoded in the chosen download format
  };

  // ---------------------------------------------------------------------------------------
  // Requests
  // ---------------------------------------------------------------------------------------
  const KEY_STORAGE = "diffmesh-playground-api-key";

  function showAuth() {
    el.authBox.hidden = false;
  }

  function headers(extra) {
    const h = new Headers(extra || {});
    const key = el.apiKey.value.trim();
    if (key) h.set("Authorization", "Bearer " + key);
    return h;
  }

  async function api(path, options) {
    const opts = options || {};
    const response = await fetch(path, { ...opts, headers: headers(opts.headers) });
    if (response.status === 401) showAuth();
    return response;
  }

  /** The API's `{"error": {message, field}}` in one line. */
  async function errorText(response) {
    try {
      const body = await response.json();
      const e = body.error || {};
      const field = e.field ? e.field + ": " : "";
      return `${response.status} ${field}${e.message || response.statusText}`;
    } catch (_) {
      return `${response.status} ${response.statusText}`;
    }
  }

  class ApiFailure extends Error {}

  async function expect(response, status) {
    if (response.status !== status) throw new ApiFailure(await errorText(response));
    return response;
  }

  // ---------------------------------------------------------------------------------------
  // Status, progress and the event log
  // ---------------------------------------------------------------------------------------
  function setStatus(text, kind) {
    el.status.textContent = text;
    el.status.dataset.state = kind || "working";
  }

  function logEvent(text) {
    const li = document.createElement("li");
    li.textContent = text;
    el.events.appendChild(li);
    el.events.scrollTop = el.events.scrollHeight;
    return li;
  }

  /** Step events update one line (`step k/N`) instead of adding one each; the line counts
   *  how many arrived. */
  function logStep(text) {
    const last = el.events.lastElementChild;
    const line = last && last.dataset.steps ? last : logEvent(text);
    line.textContent = text;
    line.dataset.steps = String(Number(line.dataset.steps || 0) + 1);
  }

  function setBusy(busy) {
    state.busy = busy;
    el.submit.disabled = busy;
    el.cancel.hidden = !busy || !state.job;
  }

  // ---------------------------------------------------------------------------------------
  // The image and the mask canvas
  // ---------------------------------------------------------------------------------------
  /** Fit the layers into the stage: the whole width, at most 70% of the window's height. */
  function layout() {
    if (!state.loaded) return;
    const w = el.imageCanvas.width, h = el.imageCanvas.height;
    const room = el.stage.clientWidth;
    const scale = Math.min(room / w, (window.innerHeight * 0.7) / h);
    el.layers.style.width = Math.max(1, Math.floor(w * scale)) + "px";
    el.layers.style.height = Math.max(1, Math.floor(h * scale)) + "px";
  }

  function showImage(img, info) {
    const w = img.naturalWidth, h = img.naturalHeight;
    for (const c of [el.imageCanvas, el.maskCanvas]) {
      c.width = w;
      c.height = h;
    }
    imageCtx.drawImage(img, 0, 0);
    maskCtx.clearRect(0, 0, w, h);
    state.loaded = true;
    el.stage.classList.remove("empty");
    el.stageHint.hidden = true;
    el.imageInfo.textContent = `${info} · ${w}×${h}`;
    layout();
  }

  function clearImage(hint) {
    state.loaded = false;
    el.stage.classList.add("empty");
    el.stageHint.hidden = false;
    el.stageHint.textContent = hint;
    el.imageInfo.textContent = "";
  }

  function loadImage(blob) {
    return new Promise((resolve, reject) => {
      const url = URL.createObjectURL(blob);
      const img = new Image();
      img.onload = () => { URL.revokeObjectURL(url); resolve(img); };
      img.onerror = () => { URL.revokeObjectURL(url); reject(new Error("the browser cannot read this image")); };
      img.src = url;
    });
  }

  function brushRadius() {
    // The slider is in screen pixels; the mask is in image pixels.
    const rect = el.maskCanvas.getBoundingClientRect();
    const perScreenPixel = rect.width > 0 ? el.maskCanvas.width / rect.width : 1;
    return (Number(el.brush.value) / 2) * perScreenPixel;
  }

  function canvasPoint(event) {
    const rect = el.maskCanvas.getBoundingClientRect();
    return {
      x: ((event.clientX - rect.left) * el.maskCanvas.width) / rect.width,
      y: ((event.clientY - rect.top) * el.maskCanvas.height) / rect.height,
    };
  }

  function paintTo(point) {
    const r = brushRadius();
    maskCtx.fillStyle = maskCtx.strokeStyle = "rgb(255, 40, 40)";
    maskCtx.lineCap = maskCtx.lineJoin = "round";
    maskCtx.lineWidth = 2 * r;
    const from = state.last || point;
    maskCtx.beginPath();
    maskCtx.moveTo(from.x, from.y);
    maskCtx.lineTo(point.x, point.y);
    maskCtx.stroke();
    maskCtx.beginPath();
    maskCtx.arc(point.x, point.y, r, 0, 2 * Math.PI);
    maskCtx.fill();
    state.last = point;
  }

  el.maskCanvas.addEventListener("pointerdown", (event) => {
    if (!state.loaded || event.button !== 0) return;
    el.maskCanvas.setPointerCapture(event.pointerId);
    state.painting = true;
    state.last = null;
    paintTo(canvasPoint(event));
    event.preventDefault();
  });
  el.maskCanvas.addEventListener("pointermove", (event) => {
    if (state.painting) paintTo(canvasPoint(event));
  });
  for (const name of ["pointerup", "pointercancel", "lostpointercapture"]) {
    el.maskCanvas.addEventListener(name, () => { state.painting = false; state.last = null; });
  }
  el.brush.addEventListener("input", () => { el.brushValue.textContent = el.brush.value; });
  el.clearMask.addEventListener("click", () => {
    maskCtx.clearRect(0, 0, el.maskCanvas.width, el.maskCanvas.height);
  });
  window.addEventListener("resize", layout);

  /** The painted region as an opaque black-and-white PNG at the image's size (white =
   *  repaint, the codec's rule for opaque masks), and how many pixels it repaints. */
  async function maskPng() {
    const w = el.maskCanvas.width, h = el.maskCanvas.height;
    const painted = maskCtx.getImageData(0, 0, w, h).data;
    const out = new ImageData(w, h);
    let count = 0;
    for (let i = 0; i < w * h; i++) {
      const on = painted[4 * i + 3] >= 128;
      const v = on ? 255 : 0;
      out.data[4 * i] = out.data[4 * i + 1] = out.data[4 * i + 2] = v;
      out.data[4 * i + 3] = 255;
      if (on) count++;
    }
    const canvas = document.createElement("canvas");
    canvas.width = w;
    canvas.height = h;
    canvas.getContext("2d").putImageData(out, 0, 0);
    const blob = await new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
    return { blob, count, total: w * h, dataUrl: canvas.toDataURL("image/png") };
  }

  // ---------------------------------------------------------------------------------------
  // Source: an upload or a registered template
  // ---------------------------------------------------------------------------------------
  function source() {
    return el.sourceTemplate.checked ? "template" : "upload";
  }

  function syncSource() {
    const s = source();
    el.uploadBox.hidden = s !== "upload";
    el.templateBox.hidden = s !== "template";
    // A template's edits must use its step count (its cache has one entry per step).
    el.steps.disabled = s === "template";
    if (s === "template") {
      el.steps.value = state.template ? state.template.num_inference_steps : "";
    }
  }

  async function onSourceChange() {
    syncSource();
    try {
      if (source() === "template") {
        await loadTemplates(state.template && state.template.id);
        await showPickedTemplate();
      } else if (state.file) {
        showImage(await loadImage(state.file), state.file.name);
      } else {
        clearImage("Upload an image or pick a template");
      }
    } catch (err) {
      setStatus(err.message, "failed");
    }
  }

  function templateLabel(t) {
    const prompt = t.prompt ? `“${t.prompt}”` : "(no prompt)";
    return `${t.id.slice(0, 8)} · ${prompt} · ${t.width}×${t.height} · ${t.num_inference_steps} steps · ${t.status}`;
  }

  /** Fill the template list (GET /v1/templates), keeping `selectId` selected. */
  async function loadTemplates(selectId) {
    const response = await api("/v1/templates");
    await expect(response, 200);
    state.templates = (await response.json()).data;
    el.templateSelect.replaceChildren();
    if (state.templates.length === 0) {
      const option = document.createElement("option");
      option.textContent = "No templates yet: upload one with “Register it as a template”";
      option.value = "";
      el.templateSelect.appendChild(option);
    }
    for (const t of state.templates) {
      const option = document.createElement("option");
      option.value = t.id;
      option.textContent = templateLabel(t);
      option.disabled = t.status !== "ready";
      el.templateSelect.appendChild(option);
    }
    const ready = state.templates.filter((t) => t.status === "ready");
    const wanted = ready.find((t) => t.id === selectId) || ready[ready.length - 1];
    el.templateSelect.value = wanted ? wanted.id : "";
  }

  async function showPickedTemplate() {
    const id = el.templateSelect.value;
    state.template = state.templates.find((t) => t.id === id) || null;
    syncSource();
    if (!state.template) {
      clearImage("No ready template: register one by uploading it");
      return;
    }
    const response = await api(`/v1/templates/${encodeURIComponent(id)}/image`);
    await expect(response, 200);
    showImage(await loadImage(await response.blob()), `template ${id.slice(0, 8)}`);
  }

  el.sourceUpload.addEventListener("change", onSourceChange);
  el.sourceTemplate.addEventListener("change", onSourceChange);
  el.templateSelect.addEventListener("change", () => {
    showPickedTemplate().catch((err) => setStatus(err.message, "failed"));
  });
  el.refreshTemplates.addEventListener("click", () => {
    loadTemplates(el.templateSelect.value)
      .then(showPickedTemplate)
      .catch((err) => setStatus(err.message, "failed"));
  });
  el.file.addEventListener("change", async () => {
    const file = el.file.files && el.file.files[0];
    if (!file) return;
    try {
      const img = await loadImage(file);
      state.file = file;
      showImage(img, file.name);
      setStatus("Paint the region to repaint", "idle");
    } catch (err) {
      setStatus(`${file.name}: ${err.message}`, "failed");
    }
  });

  // ---------------------------------------------------------------------------------------
  // Submitting and following the job
  // ---------------------------------------------------------------------------------------
  /** Register the uploaded image (POST /v1/templates waits for its capture pass). */
  async function registerTemplate() {
    setStatus("Registering the template (capture pass)…");
    logEvent("registering the uploaded image as a template");
    const form = new FormData();
    form.append("image", state.file, state.file.name);
    if (el.steps.value) form.append("num_inference_steps", el.steps.value);
    if (el.seed.value) form.append("seed", el.seed.value);
    const response = await expect(await api("/v1/templates", { method: "POST", body: form }), 201);
    const template = await response.json();
    logEvent(`template ${template.id.slice(0, 8)} ready (${template.blocks} blocks cached)`);
    el.register.checked = false;
    // From now on the picture on the canvas is that template; the mask stays as painted.
    el.sourceTemplate.checked = true;
    await loadTemplates(template.id);
    state.template = state.templates.find((t) => t.id === template.id) || template;
    syncSource();
    return template.id;
  }

  function editForm(templateId, mask) {
    const form = new FormData();
    if (templateId) {
      form.append("template_id", templateId);
    } else {
      form.append("image", state.file, state.file.name);
    }
    form.append("mask", mask.blob, "mask.png");
    form.append("prompt", el.prompt.value.trim());
    if (!templateId && el.steps.value) form.append("num_inference_steps", el.steps.value);
    if (el.seed.value) form.append("seed", el.seed.value);
    if (el.trueCfg.value) form.append("true_cfg_scale", el.trueCfg.value);
    // Previews need a step to follow them: none asked when the steps given are fewer.
    const every = Number(el.previewEvery.value);
    const steps = Number(el.steps.value);
    if (every > 0 && !(steps > 0 && every >= steps)) form.append("preview_every", String(every));
    return form;
  }

  function describe(name, data) {
    switch (name) {
      case "queued":
        return data.position == null
          ? "queued: being placed on a denoiser"
          : `queued: position ${data.position} on ${data.worker_id || "a denoiser"}` +
              (data.position === 0 ? " (next)" : "");
      case "started": return `started on ${data.worker_id || "a denoiser"}`;
      case "step": return `step ${data.step}/${data.total}`;
      case "retrying": return `retrying (attempt ${data.attempt}): ${data.reason}`;
      case "captured": return `template cache captured (${data.bytes} bytes)`;
      case "preview": return `preview after step ${data.step}/${data.total}`;
      default: return name;
    }
  }

  /** Apply one event; returns the job's ending (`{name, data}`) or null. */
  function onEvent(name, data) {
    if (["done", "failed", "cancelled", "error"].includes(name)) return { name, data };
    // Step events fold into one line; previews show in their figure, not in the log.
    if (name === "step") logStep(describe(name, data));
    else if (name !== "preview") logEvent(describe(name, data));
    if (name === "queued") {
      setStatus(data.position == null ? "Queued" : `Queued: position ${data.position}`);
    } else if (name === "started") {
      setStatus("Running");
    } else if (name === "step" && data.total > 0) {
      el.progress.max = data.total;
      el.progress.value = data.step;
      setStatus(`Step ${data.step}/${data.total}`);
    } else if (name === "retrying") {
      setStatus(`Retrying (attempt ${data.attempt})`);
    } else if (name === "preview") {
      el.preview.src = `data:image/png;base64,${data.b64_png}`;
      el.previewInfo.textContent =
        `After step ${data.step}/${data.total}: the latents projected to colours, not decoded`;
      el.previewFigure.hidden = false;
      el.previewFigure.dataset.count = String(Number(el.previewFigure.dataset.count || 0) + 1);
    }
    return null;
  }

  function parseEvent(block) {
    let name = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue; // keep-alive comment
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") name = value;
      else if (field === "data") data.push(value);
    }
    if (data.length === 0) return null;
    return { name, data: JSON.parse(data.join("\n")) };
  }

  /** Read the job's Server-Sent Events until its ending. */
  async function follow(job) {
    const controller = new AbortController();
    state.abort = controller;
    const response = await api(job.links.events, {
      headers: { Accept: "text/event-stream" },
      signal: controller.signal,
    });
    await expect(response, 200);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const event = parseEvent(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
          const ending = event && onEvent(event.name, event.data);
          if (ending) return ending;
        }
      }
    } finally {
      controller.abort();
      state.abort = null;
    }
    throw new Error("the event stream closed before the job ended");
  }

  async function showResult(view) {
    const link = view.results && view.results[0];
    if (!link) throw new Error("the job finished without a result");
    const response = await expect(await api(link.url), 200);
    const blob = await response.blob();
    if (state.resultUrl) URL.revokeObjectURL(state.resultUrl);
    state.resultUrl = URL.createObjectURL(blob);
    await new Promise((resolve, reject) => {
      el.result.onload = resolve;
      el.result.onerror = () => reject(new Error("the result is not a readable image"));
      el.result.src = state.resultUrl;
    });
    el.result.dataset.jobId = view.id;
    el.previewFigure.hidden = true;
    await updateDownload();
    const t = view.timings || {};
    el.resultInfo.textContent =
      `${el.result.naturalWidth}×${el.result.naturalHeight} · ${t.total_ms} ms in all, ` +
      `${t.queued_ms} ms queued`;
    el.resultFigure.hidden = false;
  }

  /** Point the download link at the result in the chosen format: the job's result is PNG,
   *  the browser re-encodes it for JPEG or WebP. */
  async function updateDownload() {
    if (!state.resultUrl) return;
    const wanted = el.downloadFormat.value;
    let url = state.resultUrl;
    let type = "image/png";
    if (wanted !== "image/png") {
      const canvas = document.createElement("canvas");
      canvas.width = el.result.naturalWidth;
      canvas.height = el.result.naturalHeight;
      canvas.getContext("2d").drawImage(el.result, 0, 0);
      const blob = await new Promise((resolve) => canvas.toBlob(resolve, wanted, 0.92));
      if (!blob) throw new Error(`this browser cannot encode ${wanted}`);
      if (state.downloadUrl) URL.revokeObjectURL(state.downloadUrl);
      state.downloadUrl = URL.createObjectURL(blob);
      url = state.downloadUrl;
      // A browser without the encoder hands back PNG: name the file by what it holds.
      type = blob.type || wanted;
    }
    const ext = { "image/png": "png", "image/jpeg": "jpg", "image/webp": "webp" }[type] || "png";
    el.download.href = url;
    el.download.download = `edited.${ext}`;
    el.download.dataset.type = type;
  }

  async function submit() {
    if (state.busy) return;
    setStatus("Preparing…");
    const prompt = el.prompt.value.trim();
    if (!state.loaded) return setStatus("Upload an image or pick a template first", "failed");
    if (!prompt) return setStatus("Type a prompt: what should the painted region show?", "failed");
    if (source() === "template" && !state.template) {
      return setStatus("Pick a ready template", "failed");
    }
    const mask = await maskPng();
    if (mask.count === 0) return setStatus("Paint the region to repaint on the image first", "failed");

    setBusy(true);
    state.job = null;
    el.events.replaceChildren();
    el.progress.value = 0;
    el.resultFigure.hidden = true;
    el.previewFigure.hidden = true;
    el.previewFigure.dataset.count = "0";
    el.sentMask.src = mask.dataUrl;
    el.maskFigure.hidden = false;
    try {
      let templateId = source() === "template" ? state.template.id : null;
      if (!templateId && el.register.checked) templateId = await registerTemplate();
      setStatus("Submitting…");
      const percent = ((100 * mask.count) / mask.total).toFixed(1);
      logEvent(`submitting: ${percent}% of the image masked`);
      const response = await api("/v1/images/edits", {
        method: "POST",
        body: editForm(templateId, mask),
        headers: { Prefer: "respond-async" },
      });
      await expect(response, 202);
      const job = await response.json();
      state.job = job;
      setBusy(true);
      logEvent(`job ${job.id} accepted`);
      setStatus("Accepted");
      const ending = await follow(job);
      if (ending.name === "done") {
        el.progress.value = el.progress.max;
        await showResult(ending.data);
        logEvent("done");
        setStatus("Done", "done");
      } else if (ending.name === "cancelled") {
        logEvent("cancelled");
        setStatus("Cancelled", "failed");
      } else {
        const e = (ending.data && ending.data.error) || {};
        logEvent(`${ending.name}: ${e.message || "unknown error"}`);
        setStatus(`Failed: ${e.message || "unknown error"}`, "failed");
      }
    } catch (err) {
      if (err.name !== "AbortError") {
        logEvent(`error: ${err.message}`);
        setStatus(err instanceof ApiFailure ? err.message : `Error: ${err.message}`, "failed");
      }
    } finally {
      state.job = null;
      setBusy(false);
    }
  }

  async function cancel() {
    const job = state.job;
    if (!job) return;
    el.cancel.disabled = true;
    try {
      const response = await api(job.links.self, { method: "DELETE" });
      if (!response.ok) logEvent(`cancel: ${await errorText(response)}`);
      else logEvent("cancel requested");
    } finally {
      el.cancel.disabled = false;
    }
  }

  el.submit.addEventListener("click", submit);
  el.downloadFormat.addEventListener("change", () => {
    updateDownload().catch((err) => setStatus(`Download: ${err.message}`, "failed"));
  });
  el.cancel.addEventListener("click", cancel);

  // ---------------------------------------------------------------------------------------
  // Start
  // ---------------------------------------------------------------------------------------
  if (document.body.dataset.authRequired === "true") showAuth();
  el.apiKey.value = sessionStorage.getItem(KEY_STORAGE) || "";
  el.apiKey.addEventListener("input", () => {
    sessionStorage.setItem(KEY_STORAGE, el.apiKey.value.trim());
  });
  clearImage("Upload an image or pick a template");
  syncSource();
})();
