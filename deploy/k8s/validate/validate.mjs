// Validates every manifest in deploy/k8s against the Kubernetes OpenAPI schemas (and the
// Prometheus operator's, for the ServiceMonitor), offline, with kubernetes-models:
//   node deploy/k8s/validate/validate.mjs deploy/k8s
// Prints one line per object; exits 1 naming the file, the object and the schema's error.
import { readFileSync, readdirSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";

const groups = {
  "v1": await import("kubernetes-models/v1"),
  "apps/v1": await import("kubernetes-models/apps/v1"),
  "monitoring.coreos.com/v1": await import(
    "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1"),
};

const dir = process.argv[2];
let failed = false;
const kustomization = parseAllDocuments(readFileSync(join(dir, "kustomization.yaml"), "utf8"))[0].toJS();
const files = readdirSync(dir).filter((f) => f.endsWith(".yaml") && f !== "kustomization.yaml");
for (const listed of kustomization.resources) {
  if (!files.includes(listed)) {
    console.log(`kustomization.yaml: resource ${listed} does not exist`);
    failed = true;
  }
}
for (const file of files.sort()) {
  if (!kustomization.resources.includes(file)) {
    console.log(`${file}: not listed in kustomization.yaml's resources`);
    failed = true;
  }
  for (const document of parseAllDocuments(readFileSync(join(dir, file), "utf8"))) {
    if (document.errors.length > 0) {
      console.log(`${file}: ${document.errors[0].message}`);
      failed = true;
      continue;
    }
    const object = document.toJS();
    if (object === null) continue;
    const name = `${file}: ${object.kind} ${object.metadata?.name}`;
    const Model = groups[object.apiVersion]?.[object.kind];
    if (Model === undefined) {
      console.log(`${name}: no schema for ${object.apiVersion} ${object.kind}`);
      failed = true;
      continue;
    }
    try {
      new Model(object).validate();
      console.log(`${name}: valid`);
    } catch (error) {
      console.log(`${name}: ${error.message}`);
      failed = true;
    }
  }
}
process.exit(failed ? 1 : 0);
